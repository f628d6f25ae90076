"""Every piece of advice is a command that works when pasted: tests/advice.py's checker, and
the advice doctor and the smoke give for the failures they know."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.advice import check_advice, commands_in
from tests.cli import document, invoke


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("run `qwen-kvprep frobnicate /m`", "no command"),
        ("a very large model may need `qwen-kvprep fix /m --timeout 60`", "No such option"),
        ("`qwen-kvprep revert` to take the import out", "needs"),
        ("qwen-kvprep smoke /m /n", "does not take"),
        ("`qwen-kvprep build --export /m` on a machine like this", "inside the model folder"),
        ("qwen-kvprep fix /ro/m (sets the flags)", "read-only"),
    ],
)
def test_the_checker_refuses_advice_that_fails(text: str, why: str) -> None:
    with pytest.raises(AssertionError, match=why):
        check_advice(text, models=["/m", "/ro/m"], read_only=["/ro"])


def test_the_checker_takes_advice_that_works() -> None:
    text = ("run `qwen-kvprep doctor /m`; or `qwen-kvprep fix -o /views/m /ro/m "
            "--smoke-timeout 1800`, then `qwen-kvprep prestart /views/m -- python serve.py`")
    assert check_advice(text, models=["/m", "/ro/m"], read_only=["/ro"]) == [
        "qwen-kvprep doctor /m",
        "qwen-kvprep fix -o /views/m /ro/m --smoke-timeout 1800",
        "qwen-kvprep prestart /views/m -- python serve.py",
    ]
    assert commands_in("export HF_MODULES_CACHE=DIR, then qwen-kvprep fix /m again") == [
        "qwen-kvprep fix /m"]


def test_the_smoke_s_known_causes_advise_commands_that_exist() -> None:
    from qwen_kvprep.smoke.evaluate import _HINTS as HINTS
    from qwen_kvprep.smoke.evaluate import known_cause

    for needle, _ in HINTS:
        fix = known_cause(needle, "/ckpt")
        assert fix is not None
        check_advice(fix, expect=False)


def test_doctor_s_advice_on_an_unprepared_folder(isolated_hf: Path, tmp_path: Path) -> None:
    from qwen_kvprep.tiny import generate_checkpoint

    ckpt = generate_checkpoint(tmp_path / "tiny")
    findings = document(invoke("doctor", str(ckpt), "--json"))["findings"]
    advised = [f["fix"] for f in findings if "qwen-kvprep " in (f.get("fix") or "")]
    assert advised
    for text in advised:
        check_advice(text, models=[ckpt])
