"""demo: the story it tells (fast, made-up results) and the real run from the CLI with a
cold build cache, then a warm one (slow)."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from qwen_kvprep.demo import MARKER, DemoResult, _prepare_base
from qwen_kvprep.errors import UsageError
from qwen_kvprep.findings import fail, info, ok
from qwen_kvprep.render import render_demo
from tests.cli import kvprep
from tests.remote_code import code_folder
from tests.toolkit import NO_TOOLKIT


def _smoke_summary() -> dict[str, Any]:
    return {
        "ok": True,
        "device": "cpu",
        "device_name": "cpu",
        "load_seconds": 0.8,
        "layers": 2,
        "kernel_layers": 2,
        "kernel_calls": 64,
        "kv_bytes_per_token": {
            "quantized": 1056.0,
            "unquantized": 2048.0,
            "ratio": 1056 / 2048,
            "expected_ratio": 132 / 256,
            "head_dim": 128,
            "scale_bytes": 2,
            "element_bytes": 2,
        },
        "agreement": {
            "tokens": 16,
            "identical_tokens": 16,
            "first_divergence": None,
            "first_step_rel_logit_diff": 0.0057,
        },
        "tokens_per_s": {"quantized": 150.0, "unquantized": 300.0},
        "peak_memory": {"kind": "rss_high_water", "bytes": 280 << 20},
    }


def _result(tmp_path: Path, **over: Any) -> DemoResult:
    res = DemoResult(
        base=tmp_path,
        checkpoint=tmp_path / "tiny-qwen",
        kept=False,
        findings=[
            ok("kernels.sources", "using qwen-kvprep's own kernel sources"),
            info("config.patch", "set use_cache_quantization=true, use_cache_kernel=true"),
            info("build.build", "compiled build 0123456789ab in 31 s (MAX_JOBS=1)"),
            info("modules.plant", "planted the sources in the modules cache"),
            info("checkpoint.state", "recorded what fix did"),
            ok("smoke.kernel", "the compiled extension ran in all 2 layers (64 calls)"),
        ],
        extra={"smoke": _smoke_summary(), "cache_dir": "/c"},
        smoke=_smoke_summary(),  # the summary fix's smoke step returned
        model={
            "layers": 2,
            "heads": 2,
            "head_dim": 128,
            "dtype": "bf16",
            "weights_bytes": 2_600_000,
        },
        seconds={"generate": 3.0, "fix": 40.0, "total": 43.0},
    )
    for k, v in over.items():
        setattr(res, k, v)
    return res


def test_narrative_tells_what_happened_and_what_was_measured(tmp_path: Path) -> None:
    text = render_demo(_result(tmp_path))
    assert "1. generated a tiny Qwen (v1) compatible model" in text
    assert "2 layers, 2 heads of dim 128, bf16, 2.6 MB of weights" in text
    assert "every checkpoint check passed" in text
    assert "set use_cache_quantization=true" in text
    assert "compiled build 0123456789ab in 31 s" in text
    assert "KV cache per token: 1,056 bytes instead of 2,048 (0.516x)" in text
    assert "128 one-byte codes + a 2-byte scale + a 2-byte zero point = 132 bytes" in text
    assert "agree on 16/16 tokens" in text
    assert "the compiled kernel ran in 2/2 layers (64 calls)" in text
    assert "Result: the Int8 KV cache works on this machine" in text
    assert "Problems:" not in text


def test_narrative_puts_failures_first_in_the_verdict(tmp_path: Path) -> None:
    smoke = dict(_smoke_summary(), ok=False, kernel_layers=0)
    res = _result(
        tmp_path,
        findings=[fail("smoke.kernel", "all 2 layers fell back", fix="run qwen-kvprep fix")],
        extra={"smoke": smoke},
        smoke=smoke,
    )
    text = render_demo(res)
    assert "FELL BACK" in text
    assert "FAIL  smoke.kernel: all 2 layers fell back" in text
    assert "Result: FAILED" in text and "qwen-kvprep doctor" in text


def test_demo_dir_must_be_empty_or_a_previous_demo(tmp_path: Path) -> None:
    other = tmp_path / "mine"
    other.mkdir()
    (other / "precious.txt").write_text("keep")
    with pytest.raises(UsageError):
        _prepare_base(other)
    assert (other / "precious.txt").read_text() == "keep"

    demo = tmp_path / "demo"
    base, kept = _prepare_base(demo)
    assert kept and (base / MARKER).exists()
    (base / "tiny-qwen").mkdir()
    (base / "tiny-qwen" / "config.json").write_text("{}")
    base2, _ = _prepare_base(demo)  # a previous demo's folder: its model is replaced
    assert base2 == base and not (base / "tiny-qwen").exists()


def _demo(*args: str, env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str], str]:
    """Run the demo; also its CPU seconds and the load, to tell a slow run from a busy host."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    res = kvprep("demo", *args, env=env, timeout=600)
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    note = f"{wall:.0f} s wall, {cpu:.0f} s CPU, load average {os.getloadavg()[0]:.1f}"
    return res, note


@pytest.mark.slow
def test_demo_from_a_cold_cache_then_a_warm_one(tmp_path: Path) -> None:
    env = dict(os.environ)
    env["QWEN_KVPREP_CACHE"] = str(tmp_path / "cold-build-cache")  # nothing built yet
    env.update(NO_TOOLKIT)  # the CPU-only build, whatever nvcc the machine has
    env.setdefault("MAX_JOBS", "1")
    for var in ("HF_HOME", "HF_MODULES_CACHE"):
        env.pop(var, None)  # the demo uses private ones under its folder
    where = tmp_path / "demo"

    res, cold_note = _demo(str(where), env=env)
    out = res.stdout
    assert res.returncode == 0, out + res.stderr
    assert "compiled it in the background" in out  # really cold
    assert "KV cache per token: 1,056 bytes instead of 2,048 (0.516x)" in out
    assert "agree on 16/16 tokens" in out
    assert "the compiled kernel ran in 2/2 layers" in out
    assert "demo: " not in res.stderr  # progress only on a terminal
    # the model's remote code ran from the demo's private modules cache
    assert code_folder(where / "hf" / "modules", where / "tiny-qwen").is_dir()

    # the second run reuses the build and says so; --json carries the measurements
    res, warm_note = _demo(str(where), "--json", env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    assert doc["schema_version"] == 1 and doc["ok"] is True
    ids = {f["id"]: f for f in doc["findings"]}
    assert ids["build.build"]["severity"] == "ok"  # cached
    assert doc["demo"]["background_build"]["reused"] is True  # not "compiling"
    kv = doc["demo"]["smoke"]["kv_bytes_per_token"]
    assert kv["ratio"] == pytest.approx(132 / 256)
    # how long it took is for `time qwen-kvprep demo` in .ci/run, not for an assertion
    print(f"demo: cold {cold_note}; warm {warm_note}")


def _background(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, cached: bool) -> list[str]:
    """What the demo says about its build, with the cache holding it or not (the build
    itself stubbed: this is about the words)."""
    from qwen_kvprep import demo
    from qwen_kvprep.buildcache import builder

    class Plan:
        key, mode = "k1", "cpu"

    gate = threading.Event()

    def ensure_build(*_args: object, **_kwargs: object) -> object:
        gate.wait(30)  # still compiling while the demo speaks

        class Built:
            compiled, key = True, "k1"

        return Built()

    monkeypatch.setattr(builder, "plan_build", lambda *_a: Plan())
    monkeypatch.setattr(builder, "find_build", lambda *_a: object() if cached else None)
    monkeypatch.setattr(builder, "ensure_build", ensure_build)
    said: list[str] = []
    background = demo.BackgroundBuild(tmp_path / "cache", said.append)
    background.start()
    background.announce(said.append)
    gate.set()
    background.join()
    return said


def test_demo_says_compiling_only_when_it_compiles(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    said = _background(monkeypatch, tmp_path, cached=True)
    assert len(said) == 1 and said[0].startswith("reusing the kernel extension")
    assert not any(s.startswith("compiling") for s in said)
    said = _background(monkeypatch, tmp_path, cached=False)
    assert [s for s in said if s.startswith("compiling")] and not [
        s for s in said if s.startswith("reusing")]
