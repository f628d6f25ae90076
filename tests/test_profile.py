"""`qwen-kvprep profile`: rows, findings and rendering from made-up outcomes (fast), and the
real thing on tiny checkpoints on the CPU (slow: each run is a child loading a model).

The Int8 runs use the CPU build of the extension, built once per session into the shared
build cache by `fix` (as in test_e2e_fix.py).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import pytest

from qwen_kvprep.childproc import ChildOutcome
from qwen_kvprep.common import COMPAT_FILE
from qwen_kvprep.findings import Severity
from qwen_kvprep.planning.peak import ModelShape, kv_bytes_per_token
from qwen_kvprep.probe.env import package_info
from qwen_kvprep.profile import max_batch
from qwen_kvprep.profile import runner as runner_mod
from qwen_kvprep.profile.evaluate import evaluate, human_bytes
from qwen_kvprep.profile.progress import ProgressBar, ProgressLog, progress_bar
from qwen_kvprep.profile.protocol import ENV_SIMULATE_OOM, ChildSpec
from qwen_kvprep.profile.runner import (
    ROW_FIELDS,
    Measurements,
    ProfileOptions,
    RunRecord,
    make_row,
    measure,
)
from qwen_kvprep.profile.source import ModelSource
from qwen_kvprep.profile.tables import render_text, summary, table
from qwen_kvprep.smoke.progress import StepLog
from tests.cli import ENTRY, document, kvprep
from tests.modeling_patch import patch_modeling
from tests.remote_code import transformers_release, with_compat
from tests.toolkit import NO_TOOLKIT

# The tiny checkpoint: 2 layers x K and V x 2 heads x 128 dims; bf16 unquantized, or
# 128 one-byte codes + a bf16 scale + a bf16 zero point per token and head.
TINY_UNQUANTIZED = 2 * 2 * 2 * 128 * 2
TINY_INT8 = 2 * 2 * 2 * (128 + 2 + 2)


# -- made-up outcomes ------------------------------------------------------------------------


def _spec(mode: str = "int8", batch: int = 1) -> ChildSpec:
    return ChildSpec(task="run", source="/ckpt", mode=mode, batch=batch, prompt_tokens=8,
                     new_tokens=4)


def _result(mode: str, batch: int, **over: Any) -> dict[str, Any]:
    unit = TINY_INT8 if mode == "int8" else TINY_UNQUANTIZED
    res = {
        "device": {"kind": "cpu", "name": "x86_64", "total_bytes": 8 << 30},
        "versions": {"torch": "2.x", "transformers": "4.x"},
        "dtype": "bf16", "layers": 2, "cached_tokens": 12, "kv_bytes": batch * 12 * unit,
        "peak_bytes": 300 << 20, "prefill_tokens_per_s": 1000.0,
        "decode_tokens_per_s": 500.0 / (1.2 if mode == "int8" else 1.0),
        "kernel_layers": 2 if mode == "int8" else 0, "oom": False, "error": None,
    }
    res.update(over)
    return res


def _source(random_weights: bool = False) -> ModelSource:
    return ModelSource(directory=Path("/ckpt"), load_from=Path("/ckpt"),
                       random_weights=random_weights, remote_code="checkpoint",
                       plant_kernels=random_weights)


def _record(mode: str, batch: int, **over: Any) -> RunRecord:
    spec = _spec(mode, batch)
    outcome = ChildOutcome(returncode=0, elapsed=1.5, result=_result(mode, batch, **over))
    return RunRecord(spec, outcome, make_row(spec, outcome, 60))


def _measurements(*records: RunRecord) -> Measurements:
    return Measurements(device={"kind": "cpu", "name": "x86_64", "total_bytes": 8 << 30},
                        versions={"torch": "2.x", "transformers": "4.x"},
                        batches=tuple(sorted({r.spec.batch for r in records})), new_tokens=4,
                        runs=list(records))


UNITS = {"unquantized": TINY_UNQUANTIZED, "int8": TINY_INT8}


def _by_id(findings: list[Any]) -> dict[str, Any]:
    return {f.id: f for f in findings}


def test_row_has_exactly_the_contract_fields() -> None:
    rec = _record("int8", 2)
    assert tuple(rec.row) == ROW_FIELDS
    assert rec.row["kv_bytes"] == 2 * 12 * TINY_INT8 and rec.row["seconds"] == 1.5
    assert rec.row["oom"] is False and rec.row["error"] is None


def test_child_spec_travels_as_json() -> None:
    spec = ChildSpec(task="quality", source="/x", prefill_chunk=16, text_file="/t.txt")
    assert ChildSpec.from_json(spec.to_json()) == spec


def test_timeout_crash_and_oom_killer_rows() -> None:
    spec = _spec("unquantized", 4)
    hung = make_row(spec, ChildOutcome(timed_out=True, returncode=-15, phase="decode"), 30)
    assert hung["oom"] is False and hung["error"] == "timed out after 30 s while decoding"
    crashed = make_row(spec, ChildOutcome(returncode=1, phase="load", error={
        "type": "RuntimeError", "message": "boom\nsecond line"}), 30)
    assert crashed["error"] == "RuntimeError while loading the model: boom"
    killed = make_row(spec, ChildOutcome(returncode=-9, phase="prefill"), 30)
    assert killed["oom"] is True and "SIGKILL" in killed["error"]
    assert "out-of-memory killer" in killed["error"]


def test_findings_of_a_good_profile() -> None:
    m = _measurements(*(_record(mode, b) for b in (1, 2) for mode in ("unquantized", "int8")))
    by = _by_id(evaluate(m, _source(), UNITS, 2, 60))
    assert by["profile.kernel"].severity is Severity.OK
    assert by["profile.kv_bytes"].severity is Severity.OK
    assert "0.516x" in by["profile.kv_bytes"].message
    assert "profile.oom" not in by and "profile.run" not in by


def test_cudnn_attention_baseline_is_named_with_the_option_that_avoids_it() -> None:
    m = _measurements(_record("unquantized", 1), _record("int8", 1))
    assert "profile.baseline" not in _by_id(evaluate(m, _source(), UNITS, 2, 60))
    m.device = {"kind": "cuda", "name": "H100", "total_bytes": 80 << 30, "cudnn_attention": True}
    f = _by_id(evaluate(m, _source(), UNITS, 2, 60))["profile.baseline"]
    assert "cuDNN" in f.message and "--no-cudnn-attention" in (f.fix or "")
    m.device["cudnn_attention"] = False
    assert "profile.baseline" not in _by_id(evaluate(m, _source(), UNITS, 2, 60))
    spec = ChildSpec(task="run", source="/x", cudnn_attention=False)
    assert ChildSpec.from_json(spec.to_json()).cudnn_attention is False


def test_fallback_warns_and_names_fix() -> None:
    m = _measurements(_record("unquantized", 1), _record("int8", 1, kernel_layers=0))
    f = _by_id(evaluate(m, _source(), UNITS, 2, 60))["profile.kernel"]
    assert f.severity is Severity.WARN and "0 of 2 layers" in f.message
    assert f.fix == "qwen-kvprep fix /ckpt"
    f = _by_id(evaluate(m, _source(random_weights=True), UNITS, 2, 60))["profile.kernel"]
    assert "qwen-kvprep build" in (f.fix or "")


def test_kv_bytes_message_names_the_unit_of_the_rows_beside_it() -> None:
    # fp32: the model's own Int8 code keeps fp32 scales (384 bytes a token here), the fast
    # path fp16 ones (320): the rows ran through the fast path, so the message says 320
    units = {"unquantized": 1024, "int8": 384, "int8-fast": 320}
    m = _measurements(
        _record("unquantized", 1, kv_bytes=12 * 1024),
        _record("int8", 1, kv_bytes=12 * 320, fast_layers=2),
    )
    f = _by_id(evaluate(m, _source(), units, 2, 60))["profile.kv_bytes"]
    assert f.severity is Severity.OK, f.message
    assert "320 bytes Int8 through the fast path" in f.message and "384" not in f.message
    assert "(0.312x)" in f.message
    m = _measurements(_record("int8", 2, kv_bytes=2 * 12 * 320 + 8, fast_layers=2))
    f = _by_id(evaluate(m, _source(), units, 2, 60))["profile.kv_bytes"]
    assert f.severity is Severity.WARN and "x 320 bytes" in f.message, f.message


def test_cache_of_the_wrong_size_warns() -> None:
    m = _measurements(_record("int8", 2, kv_bytes=2 * 12 * TINY_INT8 + 8))
    f = _by_id(evaluate(m, _source(), UNITS, 2, 60))["profile.kv_bytes"]
    assert f.severity is Severity.WARN and "not in the format" in f.message


def test_crash_is_a_failing_finding_with_the_last_lines_and_oom_is_not() -> None:
    spec = _spec("int8", 1)
    crashed = ChildOutcome(returncode=-11, phase="decode",
                           log_tail=["loading ...", "CUDA error: an illegal memory access"])
    oom = _record("unquantized", 1, oom=True, error="OutOfMemoryError: CUDA out of memory",
                  kv_bytes=None, cached_tokens=None)
    m = _measurements(oom, RunRecord(spec, crashed, make_row(spec, crashed, 60)))
    findings = evaluate(m, _source(), UNITS, 2, 60)
    (run,) = [f for f in findings if f.id == "profile.run"]
    assert run.severity is Severity.FAIL and "SIGSEGV" in run.message
    assert "illegal memory access" in run.message and run.fix
    assert _by_id(findings)["profile.oom"].severity is Severity.INFO


def test_after_an_oom_larger_batches_of_that_mode_are_skipped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ran: list[tuple[str, int]] = []

    def fake_child(spec: ChildSpec, source: Any, timeout: float, bar: Any,
                   label: str) -> ChildOutcome:
        if spec.task == "probe":
            return ChildOutcome(returncode=0, result=_result("unquantized", 1))
        ran.append((spec.mode, spec.batch))
        oom = spec.mode == "unquantized" and spec.batch >= 4
        return ChildOutcome(returncode=0, elapsed=1.0, result=_result(
            spec.mode, spec.batch, oom=oom, error="OutOfMemoryError: x" if oom else None))

    monkeypatch.setattr(runner_mod, "run_child", fake_child)
    found = measure(_source(), ProfileOptions(batches=(16, 1, 4, 4)))
    assert found.batches == (1, 4, 16)
    assert ran == [("unquantized", 1), ("int8", 1), ("unquantized", 4), ("int8", 4),
                   ("int8", 16)]
    skipped = found.runs[4].row
    assert (skipped["mode"], skipped["batch"], skipped["oom"]) == ("unquantized", 16, True)
    assert skipped["error"].startswith("skipped: batch 4 already ran out of memory")
    rows = [r.row for r in found.runs]
    assert max_batch(rows) == {"unquantized": 1, "int8": 16}
    line = summary({"rows": rows, "max_batch": max_batch(rows), "batches": [1, 4, 16]})
    assert "largest batch that fit: unquantized 1, int8 16+ (at least 16x" in line
    assert "decode at batch 1: int8 416.7 tok/s vs unquantized 500.0 (0.83x)" in line


def test_table_and_text() -> None:
    rows = [_record(mode, b).row for b in (1, 2) for mode in ("unquantized", "int8")]
    for r in rows:
        r["predicted_bytes"] = 3 << 20
    text = table(rows, 2)
    lines = text.splitlines()
    assert lines[0].split() == ["mode", "batch", "cached", "KV", "bytes", "peak", "predicted",
                                "decode", "tok/s", "kernel", "layers", "OOM"]
    assert lines[2].split()[-2:] == ["2/2", "no"] and "25,344" in lines[4]
    assert human_bytes(300 << 20) == "300 MiB" and human_bytes(None) == "-"
    profile = {"directory": "/ckpt", "random_weights": False, "device": {"kind": "cpu",
               "name": "x86_64"}, "dtype": "bf16", "prompt_tokens": 8, "new_tokens": 4,
               "prefill_chunk": None, "rows": rows, "model": {"layers": 2},
               "max_batch": max_batch(rows), "batches": [1, 2], "quality": None}
    assert "neither ran out of memory" in render_text(profile)


def test_on_a_cpu_the_peak_and_the_prediction_are_labelled_as_different_measures() -> None:
    """On a CPU the measured peak is the process's resident memory and plan's figure the
    CUDA allocator's peak on a GPU: the text names each and says they do not compare; on a
    GPU both are the allocator's peak and keep their plain names."""
    from qwen_kvprep.profile.document import peak_measure

    assert (peak_measure("cpu"), peak_measure("cuda")) == ("process_rss", "cuda_allocator")
    rows = [_record(mode, 1).row for mode in ("unquantized", "int8")]
    for r in rows:
        r["predicted_bytes"] = 3 << 20
    base = {"directory": "/ckpt", "random_weights": False, "dtype": "bf16",
            "prompt_tokens": 8, "new_tokens": 4, "prefill_chunk": None, "rows": rows,
            "model": {"layers": 2}, "max_batch": max_batch(rows), "batches": [1],
            "quality": None}
    cpu = render_text({**base, "device": {"kind": "cpu", "name": "x86_64"},  # type: ignore[typeddict-item]
                       "peak_measure": "process_rss"})
    heads = cpu.splitlines()[2]
    assert "peak RSS" in heads and "plan (GPU)" in heads and "predicted" not in heads, cpu
    assert "Different measures: the two columns do not compare" in cpu
    gpu = render_text({**base, "device": {"kind": "cuda", "name": "H100"},  # type: ignore[typeddict-item]
                       "peak_measure": "cuda_allocator"})
    assert "peak RSS" not in gpu and "predicted" in gpu.splitlines()[2]
    assert "Different measures" not in gpu


def test_a_cpu_plot_names_what_its_points_and_lines_measure(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from qwen_kvprep.profile.plot import write_plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    profile = {**_plot_profile(), "device": {"kind": "cpu", "name": "x86_64"},
               "peak_measure": "process_rss"}
    svg = write_plot(profile, tmp_path / "mem.svg").read_text()  # type: ignore[arg-type]
    assert "int8 measured (process RSS)" in svg and "int8 predicted (GPU allocator)" in svg


def test_progress_on_a_pipe_is_a_log_and_on_a_terminal_a_bar() -> None:
    display = progress_bar(as_json=True, total=3)  # pytest's stderr is no terminal
    assert isinstance(display, ProgressLog)
    display.close()
    stream = io.StringIO()
    log = ProgressLog(StepLog(stream, "profile", heartbeat=60), total=3)
    log.start("int8 batch 4")
    log.event({"event": "phase", "phase": "start", "t": 0.0})  # the child's own: no 2nd line
    log.event({"event": "progress", "phase": "decode", "done": 5, "total": 16})
    log.event({"event": "phase", "phase": "decode", "t": 0.0})
    log.finish_step()
    log.start("quality")
    log.close()
    lines = stream.getvalue().splitlines()
    assert [line.split("] ", 1)[1] for line in lines] == [
        "profile: 1/3 int8 batch 4: starting ...",
        "profile: 1/3 int8 batch 4: decoding ...",  # a phase, not the counters
        "profile: 2/3 quality: starting ...",
    ]
    stream = io.StringIO()
    bar = ProgressBar(stream, total=3)
    bar.start("int8 batch 4")
    bar.event({"event": "progress", "phase": "decode", "done": 5, "total": 16})
    bar.finish_step()
    bar.close()
    out = stream.getvalue()
    assert "\r[" in out and "int8 batch 4: decoding 5/16" in out and "1/3" in out


def test_stand_in_plan_kv_bytes_per_token() -> None:
    # Qwen-7B: 32 layers, 32 heads of 128, bf16
    shape = ModelShape(layers=32, heads=32, head_dim=128, hidden=4096, intermediate=22016,
                       vocab=151936, dtype_bytes=2, weights_bytes=0)
    assert kv_bytes_per_token(shape, "unquantized") == 524_288
    assert kv_bytes_per_token(shape, "int8") == 270_336


def test_is_oom_knows_every_allocator() -> None:
    import torch

    from qwen_kvprep.profile.child import is_oom

    # torch.OutOfMemoryError (newer torch) is an alias of torch.cuda.OutOfMemoryError, which
    # every torch >= 2.0 has
    oom_error = torch.cuda.OutOfMemoryError
    assert is_oom(oom_error("CUDA out of memory. Tried to allocate 2 GiB"), torch)
    assert is_oom(oom_error("Tried to allocate 2 GiB"), torch)
    assert is_oom(MemoryError(), torch)
    assert is_oom(RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: "
                               "can't allocate memory: you tried to allocate 8 bytes"), torch)
    try:
        try:
            raise oom_error("CUDA out of memory")
        except oom_error as inner:
            raise ValueError("loading failed") from inner
    except ValueError as outer:
        assert is_oom(outer, torch)
    assert is_oom(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling "
                               "`cublasCreate(handle)`"), torch)
    assert not is_oom(RuntimeError("expected scalar type Half"), torch)


def test_kernel_counter_wraps_foreign_model_code() -> None:
    from qwen_kvprep.runtime import KernelCounter

    class Extension:
        __file__ = "/cache/cache_autogptq_cuda_256.so"

        def vecquant8matmul_batched_faster_old(self, *args: Any) -> None:
            return None

        def vecquant8matmul_batched_column_compression_faster_old(self, *args: Any) -> None:
            return None

    class OwnCode:  # qwen-kvprep's tiny model code counts its own calls
        kernel_calls = 7
        cache_kernels = Extension()

    class RealQwen:  # Qwen's code does not: the extension is wrapped
        def __init__(self) -> None:
            self.cache_kernels: Any = Extension()

    class Fallback:
        cache_kernels = None

    own, real, fallback = OwnCode(), RealQwen(), Fallback()
    counter = KernelCounter([("a", own), ("b", real), ("c", fallback)])
    assert counter.calls() == [0, 0, 0]
    own.kernel_calls += 2
    real.cache_kernels.vecquant8matmul_batched_faster_old(1, 2, 3, 4, 5)
    real.cache_kernels.vecquant8matmul_batched_column_compression_faster_old(1, 2, 3, 4, 5)
    assert counter.calls() == [2, 2, 0] and counter.kernel_layers() == 2
    assert real.cache_kernels.__file__.endswith(".so")  # attributes pass through
    # a function is wrapped once, not at every lookup (the fast path looks it up at every
    # step), and every call through it still counts
    first = real.cache_kernels.vecquant8matmul_batched_faster_old
    assert real.cache_kernels.vecquant8matmul_batched_faster_old is first
    first(1, 2, 3, 4, 5)
    assert counter.calls() == [2, 3, 0]


def test_plot_png_needs_matplotlib_and_says_how(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from qwen_kvprep.errors import UsageError
    from qwen_kvprep.profile.plot import check_plot_target

    with pytest.raises(UsageError, match=r"\.svg or \.png"):
        check_plot_target(tmp_path / "plot.pdf")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    check_plot_target(tmp_path / "plot.svg")  # an SVG is drawn without it
    with pytest.raises(UsageError) as caught:
        check_plot_target(tmp_path / "plot.png")
    assert caught.value.fix is not None
    assert "plot.svg" in caught.value.fix and "pip install 'qwen-kvprep[plot]'" in caught.value.fix


def _plot_profile() -> dict[str, Any]:
    rows = [_record(mode, b).row for b in (1, 2, 4) for mode in ("unquantized", "int8")]
    rows[4].update(oom=True, peak_bytes=None, error="OutOfMemoryError: x")
    for r in rows:
        r["predicted_bytes"] = (300 + 10 * r["batch"]) << 20
    return {"rows": rows, "device": {"kind": "cuda", "name": "GPU", "total_bytes": 1 << 30},
            "directory": "/m/Qwen-7B-Chat", "prompt_tokens": 8, "new_tokens": 4}


def test_plot_draws_both_modes_as_svg_without_matplotlib(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from xml.etree import ElementTree

    from qwen_kvprep.profile.plot import write_plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # the default install has none
    out = write_plot(_plot_profile(), tmp_path / "mem.svg")  # type: ignore[arg-type]
    svg = out.read_text()
    ElementTree.fromstring(svg)  # well-formed
    for label in ("unquantized predicted", "int8 measured", "unquantized out of memory",
                  "capacity 1.0 GiB", "batch size", "peak memory (GiB)"):
        assert label in svg, label
    assert svg.count("<circle") >= 5  # the measured points (plus the legend's)
    assert not list(tmp_path.glob(".*tmp"))  # written atomically


def test_plot_draws_a_png_with_matplotlib(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from qwen_kvprep.profile.plot import write_plot

    out = write_plot(_plot_profile(), tmp_path / "mem.png")  # type: ignore[arg-type]
    assert out.read_bytes().startswith(b"\x89PNG")


def _cli(*args: str, env: Optional[dict[str, str]] = None,
         timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return kvprep(*args, env=env, timeout=timeout)


def test_folder_without_weights_is_refused_naming_random_weights(tmp_path: Path) -> None:
    folder = tmp_path / "qwen7b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen", "hidden_size": 4096}))
    res = _cli("profile", str(folder))
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert "has no weights" in res.stderr and "--random-weights" in res.stderr
    res = _cli("profile", str(folder), "--json")
    doc = json.loads(res.stdout)
    assert doc["ok"] is False and "--random-weights" in doc["error"]["fix"]


def test_bad_options_are_usage_errors(tmp_path: Path) -> None:
    for args in (["--batch", "1,x"], ["--batch", "0"], ["--quality", str(tmp_path / "no.txt")],
                 ["--plot", str(tmp_path / "p.jpg")]):
        res = _cli("profile", str(tmp_path), *args)
        assert res.returncode == 2, (args, res.stderr)
        assert "Traceback" not in res.stderr


@pytest.mark.parametrize("batch", ["1,,2", "1,2,", "1 4", "", " ", "1,-2", "0", "4,1,4"])
def test_batch_is_read_exactly_as_plan_reads_it(batch: str) -> None:
    """One parser for --batch: profile took `1,,2` as 1,2 (and `1 4` as 14) where plan
    refuses them (exit 2)."""
    from qwen_kvprep.errors import UsageError
    from qwen_kvprep.planning.sizes import parse_int_list
    from qwen_kvprep.profile import parse_batches

    try:
        planned: object = parse_int_list(batch, "--batch")
    except UsageError as exc:
        planned = exc.message
    try:
        profiled: object = parse_batches(batch)
    except UsageError as exc:
        profiled = exc.message
    assert profiled == planned
    assert parse_batches(None) is None  # the device's default batches


def test_another_family_or_a_fifo_config_is_refused_at_once(tmp_path: Path) -> None:
    """A Llama config would build a Qwen model of the wrong shape; a FIFO would block the
    read forever."""
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    res = _cli("profile", str(llama), "--random-weights", "--device", "cpu", timeout=120)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert "model_type 'llama'" in res.stderr and "Qwen (v1)" in res.stderr
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "config.json")
    for command in ("profile", "plan"):
        extra = ["--random-weights", "--device", "cpu"] if command == "profile" else []
        res = _cli(command, str(fifo), *extra, timeout=60)
        assert res.returncode == 1 and "Traceback" not in res.stderr, (command, res.stderr)
        assert "FIFO" in res.stderr or "not a regular file" in res.stderr, res.stderr


# -- the real thing on tiny checkpoints (CPU) ------------------------------------------------


def _env(tmp: Path, cache: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(HF_HOME=str(tmp / "hf-home"), HF_MODULES_CACHE=str(tmp / "hf-home" / "modules"),
               QWEN_KVPREP_CACHE=str(cache), OMP_NUM_THREADS="1", **NO_TOOLKIT)
    env.pop(ENV_SIMULATE_OOM, None)
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def fixed(tmp_path_factory: pytest.TempPathFactory, shared_build_cache: Path) -> dict[str, Any]:
    """A tiny checkpoint after `fix` (the CPU extension built into the shared cache)."""
    from qwen_kvprep.tiny import generate_checkpoint

    tmp = tmp_path_factory.mktemp("profile")
    ckpt = generate_checkpoint(tmp / "tiny")
    env = _env(tmp, shared_build_cache)
    res = _cli("fix", str(ckpt), "--no-smoke", env=env, timeout=1800)
    assert res.returncode == 0, res.stdout + res.stderr
    return {"tmp": tmp, "ckpt": ckpt, "env": env}


def _assert_exact_cache(rows: list[dict[str, Any]], cached: int) -> None:
    for r in rows:
        unit = TINY_INT8 if r["mode"] == "int8" else TINY_UNQUANTIZED
        assert r["cached_tokens"] == cached, r
        assert r["kv_bytes"] == r["batch"] * cached * unit, r


@pytest.mark.slow
def test_tiny_checkpoint_both_modes_kernel_and_quality(fixed: dict[str, Any]) -> None:
    # one batch above 1 (each row is a child loading the model; the order of several
    # batches is test_out_of_memory_is_a_row_not_a_crash's)
    res = _cli("profile", str(fixed["ckpt"]), "--json", "--quality", "--batch", "2",
               "--tokens", "6", "--prompt-tokens", "9", env=fixed["env"])
    doc = document(res)
    assert res.returncode == 0, (doc["findings"], res.stderr)
    assert "\r[" not in res.stderr  # no progress bar on a pipe: log lines
    assert "s] profile: 2/4 unquantized batch 2: decoding ..." in res.stderr, res.stderr
    p = doc["profile"]
    assert {"rows", "quality", "device", "versions", "batches", "prompt_tokens", "new_tokens",
            "prefill_chunk", "dtype", "random_weights", "timeout", "model",
            "max_batch"} <= set(p)
    assert p["device"]["kind"] == "cpu" and p["versions"]["torch"]
    assert p["peak_measure"] == "process_rss"  # not the allocator peak plan predicts
    assert p["dtype"] == "bf16" and p["model"]["layers"] == 2
    # bf16: the fast path's fp16 scales take the same bytes as the model's own bf16 ones
    assert p["model"]["kv_bytes_per_token"] == {"unquantized": TINY_UNQUANTIZED,
                                                "int8": TINY_INT8, "int8-fast": TINY_INT8}
    rows = p["rows"]
    assert [(r["mode"], r["batch"]) for r in rows] == [("unquantized", 2), ("int8", 2)]
    _assert_exact_cache(rows, 9 + 6)
    for r in rows:
        assert tuple(r) == ROW_FIELDS
        assert r["oom"] is False and r["error"] is None
        assert r["kernel_layers"] == (2 if r["mode"] == "int8" else 0)  # every layer
        assert r["peak_bytes"] > 0 and r["predicted_bytes"] > 0
        assert r["decode_tokens_per_s"] > 0 and r["prefill_tokens_per_s"] > 0
    q = p["quality"]
    assert set(q) >= {"top1_agreement", "ppl_unquantized", "ppl_int8", "mean_abs_logit_diff",
                      "max_abs_logit_diff", "tokens"}
    assert q["text"] == "built-in passage" and q["tokens"] >= 300
    assert q["kernel_layers"] == 2
    assert 0.95 <= q["top1_agreement"] <= 1.0
    # the 8-bit cache moves logits a little, never a lot (the tiny model's logits span ~30)
    assert 0 < q["mean_abs_logit_diff"] < q["max_abs_logit_diff"] < 1.0
    assert q["ppl_int8"] == pytest.approx(q["ppl_unquantized"], rel=0.05)
    by = {f["id"]: f for f in doc["findings"]}
    assert by["profile.kernel"]["severity"] == "ok"
    assert by["profile.kv_bytes"]["severity"] == "ok"
    assert by["profile.quality"]["severity"] == "info"


def _drain(fd: int, sink: list[bytes]) -> None:
    while True:
        try:
            data = os.read(fd, 4096)
        except OSError:
            return
        if not data:
            return
        sink.append(data)


@pytest.mark.slow
def test_out_of_memory_is_a_row_not_a_crash(fixed: dict[str, Any]) -> None:
    """A simulated allocator failure above batch 1; stderr on a terminal shows the bar."""
    env = _env(fixed["tmp"], Path(fixed["env"]["QWEN_KVPREP_CACHE"]),
               **{ENV_SIMULATE_OOM: "1"})
    master, slave = os.openpty()
    captured: list[bytes] = []
    reader = threading.Thread(target=_drain, args=(master, captured), daemon=True)
    reader.start()
    try:
        res = subprocess.run(
            [*ENTRY, "profile", str(fixed["ckpt"]), "--batch",
             "1,2,4", "--tokens", "2"],
            stdout=subprocess.PIPE, stderr=slave, text=True, env=env, timeout=600)
    finally:
        os.close(slave)
        reader.join(timeout=10)
        os.close(master)
    bar = b"".join(captured).decode(errors="replace")
    assert res.returncode == 0, res.stdout + bar
    assert "\r[" in bar and "int8 batch 2" in bar and "Traceback" not in bar
    out = res.stdout
    lines = {tuple(line.split()[:2]): line for line in out.splitlines()
             if line.startswith(("unquantized ", "int8 "))}
    assert lines[("unquantized", "1")].rstrip().endswith("no")
    assert lines[("int8", "2")].rstrip().endswith("OOM")
    assert lines[("int8", "4")].rstrip().endswith("OOM (skipped)")
    assert "largest batch that fit: unquantized 1, int8 1 (1x with the Int8 cache)" in out
    assert "profile.oom" in out and "FAIL" not in out


@pytest.mark.slow
def test_out_of_memory_in_json(fixed: dict[str, Any]) -> None:
    env = _env(fixed["tmp"], Path(fixed["env"]["QWEN_KVPREP_CACHE"]),
               **{ENV_SIMULATE_OOM: "1"})
    res = _cli("profile", str(fixed["ckpt"]), "--json", "--batch", "2,4", "--tokens", "2",
               env=env)
    doc = document(res)
    assert res.returncode == 0 and doc["ok"] is True
    rows = doc["profile"]["rows"]
    assert all(r["oom"] for r in rows)
    assert "simulated out of memory" in rows[0]["error"]
    assert rows[0]["peak_bytes"] > 0 and rows[0]["predicted_bytes"] > 0
    assert rows[2]["error"].startswith("skipped") and rows[2]["seconds"] == 0
    assert doc["profile"]["max_batch"] == {"unquantized": None, "int8": None}


@pytest.fixture()
def config_only(tmp_path: Path) -> Iterator[Path]:
    """A folder with nothing but a bare config.json (no auto_map: no model code to name)."""
    from qwen_kvprep.tiny import generate_checkpoint

    full = generate_checkpoint(tmp_path / "full", layers=3)
    folder = tmp_path / "cfg"
    folder.mkdir()
    config = json.loads((full / "config.json").read_text())
    config.pop("auto_map")
    (folder / "config.json").write_text(json.dumps(config))
    yield folder


@pytest.mark.slow
def test_random_weights_from_a_config_alone(
    fixed: dict[str, Any], config_only: Path, tmp_path: Path
) -> None:
    env = _env(tmp_path, Path(fixed["env"]["QWEN_KVPREP_CACHE"]))
    res = _cli("profile", str(config_only), "--random-weights", "--json", "--batch", "3",
               "--tokens", "4", "--prompt-tokens", "5", "--quality", env=env)
    doc = document(res)
    assert res.returncode == 0, (doc["findings"], res.stderr)
    p = doc["profile"]
    assert p["source"]["weights"] == "random" and p["source"]["remote_code"] == "qwen-kvprep"
    rows = p["rows"]
    # 3 layers now
    for r in rows:
        unit = (TINY_INT8 if r["mode"] == "int8" else TINY_UNQUANTIZED) * 3 // 2
        assert r["kv_bytes"] == 3 * 9 * unit and r["cached_tokens"] == 9
    assert [r["kernel_layers"] for r in rows] == [0, 3]
    assert p["quality"]["text"].startswith("synthetic") and p["quality"]["kernel_layers"] == 3
    # the assembled folder ran from a private modules cache: the user's stays untouched
    modules = tmp_path / "hf-home" / "modules" / "transformers_modules"
    assert not modules.exists() or not any(modules.iterdir())


@pytest.mark.slow
def test_unfixed_checkpoint_falls_back_and_names_fix(
    fixed: dict[str, Any], tmp_path: Path
) -> None:
    from qwen_kvprep.tiny import generate_checkpoint

    ckpt = generate_checkpoint(tmp_path / "unfixed")
    env = _env(tmp_path, Path(fixed["env"]["QWEN_KVPREP_CACHE"]))
    stream_ok = package_info("transformers_stream_generator").found
    if transformers_release() >= (4, 57) or not stream_ok:
        # Qwen's code as shipped does not load at all (from 4.57, or where chat_stream's
        # import cannot be met): the failure names fix
        res = _cli("profile", str(ckpt), "--json", "--batch", "1", "--tokens", "3", env=env)
        f = {f["id"]: f for f in document(res)["findings"]}["profile.run"]
        assert res.returncode == 1 and f["severity"] == "fail"
        assert f"qwen-kvprep fix {ckpt}" in f["fix"] and COMPAT_FILE in f["fix"]
        with_compat(ckpt)  # the compatibility lines alone: the model loads, no kernel
    res = _cli("profile", str(ckpt), "--json", "--batch", "1", "--tokens", "3", env=env)
    doc = document(res)
    assert res.returncode == 0
    assert [r["kernel_layers"] for r in doc["profile"]["rows"]] == [0, 0]
    _assert_exact_cache(doc["profile"]["rows"], 32 + 3)
    f = {f["id"]: f for f in doc["findings"]}["profile.kernel"]
    assert f["severity"] == "warn" and f["fix"] == f"qwen-kvprep fix {ckpt}"


@pytest.mark.slow
def test_crashing_model_code_is_a_clean_failure(fixed: dict[str, Any], tmp_path: Path) -> None:
    from qwen_kvprep.tiny import generate_checkpoint

    ckpt = generate_checkpoint(tmp_path / "broken")
    with_compat(ckpt)  # so that it fails where the test makes it fail, on every transformers
    patch_modeling(ckpt, 'raise RuntimeError("tiny attention refuses to start (test)")')
    env = _env(tmp_path, Path(fixed["env"]["QWEN_KVPREP_CACHE"]))
    res = _cli("profile", str(ckpt), "--batch", "1,2", "--tokens", "2", env=env)
    assert res.returncode == 1 and "Traceback" not in res.stderr + res.stdout
    assert "FAIL  profile.run" in res.stdout
    assert "tiny attention refuses to start (test)" in res.stdout
    assert "last lines of its output" in res.stdout
    assert res.stdout.count("skipped") == 2  # batch 2 of each mode is not tried
