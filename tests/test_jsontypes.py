"""jsontypes.as_json_object: what we write as JSON is checked to be JSON first."""

from __future__ import annotations

from pathlib import Path

import pytest

from qwen_kvprep.jsontypes import as_json_object


def test_json_object_passes_unchanged() -> None:
    value = {"ok": True, "n": 3, "x": 1.5, "s": "a", "none": None, "l": [1, {"k": [None]}]}
    assert as_json_object(value) is value


@pytest.mark.parametrize(
    "value",
    [[1], "text", {1: "int key"}, {"t": (1, 2)}, {"p": Path("/x")}, {"d": {"deep": {3}}}],
)
def test_anything_else_is_refused(value: object) -> None:
    with pytest.raises(TypeError, match="not a JSON object"):
        as_json_object(value)
