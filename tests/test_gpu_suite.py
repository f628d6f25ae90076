"""bench/gpu: the GPU suite's CPU path (what runs, what is skipped and why, the JSON it
writes) and the pieces of its GPU steps that run anywhere: the correctness check through
the CPU extension, the end-to-end target checks, the Markdown report."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
GPU = ROOT / "bench" / "gpu"


def _load(name: str, path: Path) -> ModuleType:
    sys.path.insert(0, str(path.parent))
    try:
        loader = importlib.machinery.SourceFileLoader(name, str(path))
        spec = importlib.util.spec_from_loader(name, loader)
        assert spec is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod  # dataclasses look their module up there
        loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(path.parent))


@pytest.fixture(scope="module")
def runner() -> ModuleType:
    return _load("kvprep_gpu_run", GPU / "run")


def test_without_gpu_cuda_steps_are_skipped_and_the_rest_runs(tmp_path: Path) -> None:
    out = tmp_path / "out"
    only = [
        "kernels-correctness", "kernels-bench", "tiny-smoke-cuda", "tiny-gptq",
        "profile-7b-speed", "doctor",
    ]  # fmt: skip
    res = subprocess.run(
        [
            sys.executable,
            str(GPU / "run"),
            "--out",
            str(out),
            "--bundle",
            str(tmp_path / "none"),
            "--only",
            *only,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    doc = json.loads((out / "gpu-results.json").read_text())
    steps = {s["name"]: s for s in doc["steps"]}
    assert list(steps) == only
    for s in doc["steps"]:
        assert set(s) == {"name", "status", "reason", "seconds"}
        assert s["status"] in ("passed", "failed", "skipped")
    for name in only[:-1]:
        assert steps[name]["status"] == "skipped"
        assert "no GPU" in steps[name]["reason"]
    assert steps["doctor"]["status"] == "passed", steps["doctor"]
    assert res.returncode == 0, res.stdout + res.stderr
    assert "qwen-kvprep report" in doc["measurements"]["doctor"]["report"]
    # a missing bundle is said, and the checkout is measured instead
    assert "bench/gpu/prepare" in doc["machine"]["bundle"]
    md = (out / "gpu-results.md").read_text()
    assert "| kernels-correctness | skipped |" in md
    assert (out / "gpu-logs.tar.gz").stat().st_size > 0


def test_unknown_step_is_a_usage_error(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, str(GPU / "run"), "--out", str(tmp_path), "--only", "nope"],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 2
    assert "unknown step" in res.stderr and "kernels-bench" in res.stderr


def test_a_failing_step_gives_exit_3_and_the_others_still_run(tmp_path: Path) -> None:
    # plan-7b on a folder that is not a checkpoint fails; doctor after it still runs.
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r});"
        "from test_gpu_suite import _load;"
        f"mod = _load('r', __import__('pathlib').Path({str(GPU / 'run')!r}));"
        f"mod.SEVEN_B = mod.Path({str(tmp_path / 'missing')!r});"
        f"raise SystemExit(mod.main(['--out', {str(tmp_path / 'o')!r}, '--only', 'plan-7b', "
        "'doctor', '--bundle', '/nonexistent']))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    doc = json.loads((tmp_path / "o" / "gpu-results.json").read_text())
    status = {s["name"]: s["status"] for s in doc["steps"]}
    assert status == {"plan-7b": "failed", "doctor": "passed"}, doc["steps"]
    assert res.returncode == 3


def test_profile_checks_judge_the_end_to_end_targets(runner: ModuleType) -> None:
    def row(mode: str, batch: int, oom: bool = False, new: int = 8, tps: float = 0.0) -> dict:
        return {
            "mode": mode,
            "batch": batch,
            "cached_tokens": 1024,
            "new_tokens": new,
            "oom": oom,
            "decode_tokens_per_s": tps,
        }

    rows = [
        row("unquantized", 1),
        row("unquantized", 16),
        row("unquantized", 32, oom=True),
        row("int8", 1),
        row("int8", 16),
        row("int8", 32),
        row("unquantized", 1, new=1024, tps=30.0),
        row("int8", 1, new=1024, tps=28.0),
    ]
    checks = {c["name"]: c for c in runner.profile_checks(rows)}
    speed = checks["decode tokens/s at batch 1: int8 >= 0.9x unquantized"]
    assert speed["met"] and abs(speed["value"] - 28 / 30) < 1e-9
    batch = checks["largest batch at 1024 tokens: int8 >= 1.8x unquantized"]
    assert batch["met"] and batch["value"] == 2.0
    rows[-1]["decode_tokens_per_s"] = 20.0
    rows[5]["oom"] = True
    checks = {c["name"]: c for c in runner.profile_checks(rows)}
    assert not checks["decode tokens/s at batch 1: int8 >= 0.9x unquantized"]["met"]
    assert not checks["largest batch at 1024 tokens: int8 >= 1.8x unquantized"]["met"]


def test_markdown_names_the_machine_and_every_step(runner: ModuleType) -> None:
    doc = {
        "date": "2026-01-01T00:00:00+00:00",
        "quick": False,
        "machine": {
            "gpu": "NVIDIA H100 80GB HBM3, 580.1, 81559 MiB",
            "torch": "2.11.0+cu130",
            "cuda": "13.0",
            "python": "3.12.3",
            "transformers": "4.53.3",
            "cpus": 16,
        },
        "steps": [{"name": "kernels-bench", "status": "failed", "reason": "a | b", "seconds": 1.0}],
        "measurements": {
            "profile-7b-batch": {
                "rows": [
                    {
                        "mode": "int8",
                        "batch": 4,
                        "cached_tokens": 1024,
                        "peak_bytes": 2**30 * 17.5,
                        "predicted_bytes": 2**30 * 17.0,
                        "kv_bytes": 2**30,
                        "oom": False,
                        "kernel_layers": 32,
                        "decode_tokens_per_s": 100.0,
                        "prefill_tokens_per_s": 5e3,
                    },
                ]
            }
        },
    }
    md = runner.markdown(doc)
    assert "NVIDIA H100 80GB HBM3" in md and "torch 2.11.0+cu130" in md
    assert "| kernels-bench | failed | 1.0 | a \\| b |" in md
    assert "| int8 | 4 | 1024 | 17.50 | 17.00 | 17.2 |" in md  # Qwen's figure beside ours


def test_correctness_check_runs_the_cpu_extension(cpu_kernel_ext: ModuleType) -> None:
    corr = _load("kvprep_gpu_correctness", GPU / "correctness.py")
    for case in corr.SMALL:
        r = corr.check_case(cpu_kernel_ext, case, "cpu")
        assert r["ok"], r
        assert set(r["paths"]) == {"cpu"}
        assert r["fallback"]["pv"] > r["paths"]["cpu"]["pv"]  # the fallback is less exact


def test_correctness_check_can_fail(cpu_kernel_ext: ModuleType) -> None:
    corr = _load("kvprep_gpu_correctness2", GPU / "correctness.py")

    class Off:  # a kernel that is off by one part in a thousand
        def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
            fn = getattr(cpu_kernel_ext, name)

            def wrapped(vec, mat, mul, scales, zeros):  # type: ignore[no-untyped-def]
                fn(vec, mat, mul, scales, zeros)
                mul.mul_(1.001)

            return wrapped

    r = corr.check_case(Off(), corr.SMALL[0], "cpu")
    assert not r["ok"]


def test_view_and_quantize_checks_run_the_cpu_extension(cpu_kernel_ext: ModuleType) -> None:
    corr = _load("kvprep_gpu_correctness3", GPU / "correctness.py")
    for vc in corr.SMALL_VIEW_CASES:
        r = corr.check_view_case(cpu_kernel_ext, vc, "cpu")
        assert r["ok"], r
        assert set(r["paths"]) == {"cpu"}
    cases = corr.quantize_cases("cpu", small=True)
    assert {c["dtype"] for c in cases} == {"bfloat16", "float16", "float32"}
    assert {c["s"] for c in cases} == {1, 37}
    for qc in cases:
        r = corr.check_quantize_case(cpu_kernel_ext, qc, "cpu")
        assert r["ok"], r


def test_view_and_quantize_checks_can_fail(cpu_kernel_ext: ModuleType) -> None:
    corr = _load("kvprep_gpu_correctness4", GPU / "correctness.py")

    class Broken:  # views read one token short; quantize_append writes one code too many
        def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
            fn = getattr(cpu_kernel_ext, name)
            if name == "quantize_append":

                def append(x, codes, scales, zeros, pos, key, per_token):  # type: ignore[no-untyped-def]
                    fn(x, codes, scales, zeros, pos, key, per_token)
                    codes.view(-1)[-1] ^= 1

                return append

            def op(vec, mat, mul, scales, zeros):  # type: ignore[no-untyped-def]
                fn(vec, mat, mul, scales, zeros)
                if not mat.is_contiguous():
                    mul.view(-1)[0] += 1

            return op

    assert not corr.check_view_case(Broken(), corr.SMALL_VIEW_CASES[0], "cpu")["ok"]
    r = corr.check_quantize_case(Broken(), corr.quantize_cases("cpu", small=True)[0], "cpu")
    assert not r["ok"] and not r["rest_untouched"]


def test_markdown_reports_views_and_quantize_append(runner: ModuleType) -> None:
    doc = {
        "date": "2026-01-01T00:00:00+00:00",
        "quick": True,
        "machine": {},
        "steps": [],
        "measurements": {
            "kernels-correctness": {
                "views": [
                    {
                        "name": "decode view",
                        "b": 1,
                        "h": 2,
                        "q": 1,
                        "seq": 9,
                        "cap": 21,
                        "paths": {"default": {"qk": True, "pv": False}},
                    },
                ],
                "quantize_append": [
                    {
                        "dtype": "bfloat16",
                        "s": 37,
                        "per_token": True,
                        "key_layout": False,
                        "codes_differing": 0,
                        "scales_zeros_equal": True,
                    },
                ],
            }
        },
    }
    md = runner.markdown(doc)
    assert "| decode view | 1 | 2 | 1 | 9 | 21 | default | True | False |" in md
    assert "| bfloat16 | 37 | True | False | 0 | True |" in md


def test_remote_code_runs_the_7b_steps_on_those_files(tmp_path: Path) -> None:
    """--remote-code DIR: the Qwen-7B steps get a folder with DIR's .py files beside the
    config, and the report says whose code ran (here the imitation's files stand in for
    Qwen's, which are not in the repository)."""
    remote = tmp_path / "remote"
    remote.mkdir()
    for src in (ROOT / "qwen_kvprep" / "tiny" / "remote").glob("*.py"):
        (remote / src.name).write_bytes(src.read_bytes())
    out = tmp_path / "out"
    res = subprocess.run(
        [sys.executable, str(GPU / "run"), "--out", str(out), "--bundle", str(tmp_path / "none"),
         "--only", "plan-7b", "--remote-code", str(remote)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads((out / "gpu-results.json").read_text())
    assert doc["steps"][0]["status"] == "passed", doc["steps"]
    said = doc["machine"]["remote_code"]
    assert said.startswith(f"Qwen's remote code from {remote}") and "sha256" in said
    assert f"Qwen-7B steps: {said}." in (out / "gpu-results.md").read_text()
    planned = Path(doc["measurements"]["plan-7b"]["plan"]["directory"])
    assert planned.name == "qwen-7b-chat-remote"  # the assembled folder, not tests/data's

    (remote / "modeling_qwen.py").unlink()
    res = subprocess.run(
        [sys.executable, str(GPU / "run"), "--out", str(out), "--only", "plan-7b",
         "--remote-code", str(remote)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert res.returncode == 2 and "no modeling_qwen.py there" in res.stderr
