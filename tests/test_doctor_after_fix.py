"""doctor on what a user meets after fix: model code that is not UTF-8, a fix that stopped
between its first change and its record, a folder fixed through another path."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from qwen_kvprep.tiny import generate_checkpoint
from tests.cli import document, kvprep

pytestmark = pytest.mark.usefixtures("isolated_hf")


def _findings(directory: Path, *ids: str) -> dict[str, list[dict[str, Any]]]:
    """doctor in a process of its own: transformers fixes its modules cache at import, and
    a test's own HF_MODULES_CACHE must be the one both fix and doctor use."""
    args = [a for i in ids for a in ("--check", i)]
    doc = document(kvprep("doctor", str(directory), "--json", *args))
    out: dict[str, list[dict[str, Any]]] = {}
    for f in doc["findings"]:
        out.setdefault(f["id"], []).append(f)
    return out


def test_model_code_that_is_not_utf8_is_named_as_such(tmp_path: Path) -> None:
    ckpt = generate_checkpoint(tmp_path / "ckpt")
    code = ckpt / "modeling_qwen.py"
    lines = code.read_bytes().count(b"\n")
    with open(code, "ab") as fh:
        fh.write(b"# caf\xe9\n")
    found = _findings(ckpt, "checkpoint.remote_code")["checkpoint.remote_code"][0]
    assert found["severity"] == "fail"
    assert f"modeling_qwen.py is not UTF-8 (byte 0xe9 at line {lines + 1})" in found["message"]
    assert "modeling_qwen.py" in found["fix"] and "UTF-8" in found["fix"]


def test_a_fix_that_stopped_before_its_record_is_said(tmp_path: Path) -> None:
    ckpt = generate_checkpoint(tmp_path / "ckpt")
    res = kvprep("fix", str(ckpt), "--no-build", "--no-smoke", "-q")
    assert res.returncode == 0, res.stderr
    # what a fix stopped after its changes and before its last step leaves: the journal
    # of what it changed, and no state (a full disk refused the state's write)
    (ckpt / ".qwen-kvprep" / "state.json").unlink()
    found = _findings(ckpt, "state.record")["state.record"]
    assert [f["severity"] for f in found] == ["warn"], found
    assert "recorded no state: that fix did not finish" in found[0]["message"]
    assert f"qwen-kvprep fix {ckpt}" in found[0]["fix"]
    assert f"qwen-kvprep revert {ckpt}" in found[0]["fix"]


def test_a_folder_fixed_through_another_path_is_not_blamed_on_a_killed_fix(
    tmp_path: Path,
) -> None:
    """fix through a path that is gone now (a bind mount, a container's path; here a link
    removed since): its record in the modules cache is this folder's own, not debris."""
    ckpt = generate_checkpoint(tmp_path / "ckpt")
    mounted = tmp_path / "mnt"
    mounted.symlink_to(ckpt)
    res = kvprep("fix", str(mounted), "--no-build", "--no-smoke", "-q")
    assert res.returncode == 0, res.stderr
    os.unlink(mounted)
    found = _findings(ckpt, "state.record")["state.record"]
    assert [f["severity"] for f in found] == ["ok"], found
    assert not any("killed" in f["message"] for f in found)
