"""bench/gpu's convert-7b-decode step at tiny size on the CPU: the converted model through
transformers' static cache against Qwen's remote code, in one process, and the suite's
handling of the step (skipped without a GPU; its summary and its table in the report)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from qwen_kvprep.tiny import generate_checkpoint
from tests import needs
from tests.remote_code import transformers_release
from tests.test_gpu_suite import GPU, _load


@pytest.fixture(scope="module")
def runner() -> ModuleType:
    return _load("kvprep_gpu_run_convert", GPU / "run")


@pytest.mark.slow
def test_the_converted_model_decodes_beside_the_remote_code_on_cpu(tmp_path: Path) -> None:
    if transformers_release() < (4, 37):
        needs.skip("transformers-4.37", "this transformers has no Qwen2ForCausalLM")
    src = generate_checkpoint(tmp_path / "Tiny-Chat", dtype="fp32", layers=1)
    js = tmp_path / "cd.json"
    res = subprocess.run(
        [sys.executable, str(GPU / "convert_decode.py"), str(src), "--device", "cpu",
         "--batch", "1,2", "--prompt-tokens", "12", "--tokens", "4", "--rounds", "1",
         "--no-compile", "--json", str(js), "--work", str(tmp_path)],
        capture_output=True, text=True, timeout=900,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    doc = json.loads(js.read_text())
    assert [r["batch"] for r in doc["rows"]] == [1, 2]
    for row in doc["rows"]:
        assert set(row["median"]) == {"remote-unquantized", "remote-int8-fast", "converted-static"}
        assert all(v is not None and v > 0 for v in row["median"].values()), row
    assert doc["convert_seconds"] > 0 and not doc["compiled"]
    assert "| batch | remote code, plain cache tok/s |" in res.stdout
    assert "converted / fast path" in res.stdout
    # the checkpoints it wrote are gone with the run
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("convert-decode-")] == []


def test_without_gpu_the_step_is_skipped(tmp_path: Path) -> None:
    out = tmp_path / "out"
    subprocess.run(
        [sys.executable, str(GPU / "run"), "--out", str(out), "--bundle", str(tmp_path / "none"),
         "--only", "convert-7b-decode"],
        capture_output=True, text=True, timeout=600,
    )
    (step,) = json.loads((out / "gpu-results.json").read_text())["steps"]
    assert step["name"] == "convert-7b-decode" and step["status"] == "skipped"
    assert "no GPU" in step["reason"]


def test_the_step_summary_and_its_table_in_the_report(runner: ModuleType) -> None:
    rows = [
        {"batch": 1, "median": {"remote-unquantized": 40.0, "remote-int8-fast": 50.0,
                                "converted-static": 150.0}},
        {"batch": 32, "median": {"remote-unquantized": 900.0, "remote-int8-fast": None,
                                 "converted-static": 3000.0}},
    ]
    text = runner.convert_decode_summary(rows)
    assert "batch 1: converted 150.0 tok/s, 3.00x the fast path (50.0)" in text
    assert "batch 32: converted 3000.0, fast path None (out of memory)" in text
    table = ["# NVIDIA H100; ...", "| batch | remote code, plain cache tok/s |", "| 1 | 40.0 |"]
    doc = {"date": "2026-01-01T00:00:00+00:00", "quick": True, "machine": {}, "steps": [],
           "measurements": {"convert-7b-decode": {"table": table}}}
    md = runner.markdown(doc)
    assert "### Decode speed, the converted Qwen-7B" in md and "| 1 | 40.0 |" in md
