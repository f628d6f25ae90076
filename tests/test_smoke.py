"""smoke: verdicts and thresholds on made-up child outcomes (fast), the child-process
runner on stand-in children (fast), and the real thing on generated checkpoints (slow:
they need the CPU build of the extension, shared by the session)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shlex
import signal
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Optional

import pytest

from qwen_kvprep.findings import Finding, Severity
from qwen_kvprep.smoke import expected_ratio
from qwen_kvprep.smoke import runner as runner_mod
from qwen_kvprep.smoke.evaluate import MAX_REL_LOGIT_DIFF, evaluate
from qwen_kvprep.smoke.protocol import FALLBACK_WARNINGS
from qwen_kvprep.smoke.record import state_entry
from qwen_kvprep.smoke.runner import ChildOutcome, SmokeOptions, run_child, tail_lines
from tests.advice import check_advice
from tests.cli import document, kvprep
from tests.modeling_patch import patch_modeling

# -- the bytes-per-token formula ----------------------------------------------------------


def test_expected_ratio_matches_the_format() -> None:
    # D=128 with bf16 scale/zero: 128 + 2 + 2 = 132 bytes against 256
    assert expected_ratio(128, 2, 2) == pytest.approx(132 / 256)
    assert round(expected_ratio(128, 2, 2), 3) == 0.516
    assert expected_ratio(128, 4, 4) == pytest.approx(136 / 512)  # fp32 model
    assert expected_ratio(64, 2, 2) == pytest.approx(68 / 128)
    assert expected_ratio(64, 4, 4) == pytest.approx(72 / 256)


# -- verdicts on made-up outcomes -------------------------------------------------------


def _layer(
    i: int, *, loaded: bool = True, compiled: bool = True, calls: int = 32
) -> dict[str, Any]:
    return {
        "name": f"transformer.h.{i}.attn",
        "use_cache_quantization": True,
        "use_cache_kernel": True,
        "kernel": {
            "loaded": loaded,
            "module": "cache_autogptq_cuda_256" if loaded else None,
            "file": "/c/builds/k/cache_autogptq_cuda_256.so" if compiled else None,
            "compiled": compiled and loaded,
        },
        "kernel_calls": calls if loaded else 0,
    }


def _qcache(layers: int = 2, s: int = 7, h: int = 2, d: int = 128) -> dict[str, Any]:
    per_layer = 2 * h * s * (d + 4)
    return {
        "bytes_per_token": layers * per_layer / s,
        "layers": [
            {
                "bytes": per_layer,
                "layout": "quantized",
                "q_dtype": "uint8",
                "v_dtype": "uint8",
                "q_shape": [1, h, s, d],
                "scale_shape": [1, h, s, 1],
                "zero_shape": [1, h, s, 1],
                "scale_dtype": "bfloat16",
                "scale_bytes": 2,
                "heads": h,
                "head_dim": d,
                "per_token": True,
            }
            for _ in range(layers)
        ],
    }


def _ucache(layers: int = 2, s: int = 7, h: int = 2, d: int = 128) -> dict[str, Any]:
    per_layer = 2 * h * s * d * 2
    return {
        "bytes_per_token": layers * per_layer / s,
        "layers": [
            {
                "bytes": per_layer,
                "layout": "plain",
                "dtype": "bfloat16",
                "shape": [1, s, h, d],
                "element_bytes": 2,
            }
            for _ in range(layers)
        ],
    }


def _result(**over: Any) -> dict[str, Any]:
    tokens = list(range(10, 26))
    res: dict[str, Any] = {
        "device": "cpu",
        "device_name": "cpu",
        "torch": "2.x",
        "torch_cuda": None,
        "transformers": "4.37.2",
        "prompt": "p",
        "prompt_tokens": 7,
        "max_new_tokens": 16,
        "load_seconds": 0.5,
        "load_warnings": [],
        "model_dtype": "bfloat16",
        "model_code": "/m/modeling_qwen.py",
        "compat": [],
        "numbers": {
            "tensors_compared": 19, "tensors_stored": 19, "tensors_differ": 0,
            "tensors_differ_names": [], "buffers_compared": 9, "buffers_differ": 0,
            "buffers_differ_names": [], "seconds": 0.01,
        },
        "layers": [_layer(0), _layer(1)],
        "first_step": {
            "max_abs_logit_diff": 0.1,
            "logit_range": 20.0,
            "argmax_quantized": 10,
            "argmax_unquantized": 10,
        },
        "comparison": {
            "tokens": 16,
            "identical_tokens": 16,
            "first_divergence": None,
            "steps_compared": 16,
            "max_abs_logit_diff": 0.15,
            "max_rel_logit_diff": 0.0075,
            "divergence_margin": None,
            "divergence_rel_margin": None,
        },
        "quantized": {
            "enabled": True,
            "tokens": tokens,
            "text": "q",
            "cache": _qcache(),
            "prefill_seconds": 0.01,
            "decode_seconds": 0.1,
            "decode_tokens_per_s": 150.0,
        },
        "unquantized": {
            "tokens": tokens,
            "text": "u",
            "cache": _ucache(),
            "prefill_seconds": 0.01,
            "decode_seconds": 0.05,
            "decode_tokens_per_s": 300.0,
        },
        "peak_memory": {"kind": "rss_high_water", "bytes": 300 << 20},
    }
    res.update(over)
    return res


def _judge(result: Optional[dict[str, Any]] = None, **outcome: Any) -> dict[str, Finding]:
    out = ChildOutcome(result=result, **outcome)
    findings, summary = evaluate(out, SmokeOptions(timeout=30), "/ckpt")
    by_id = {f.id: f for f in findings}
    assert summary["ok"] is not any(f.severity is Severity.FAIL for f in findings)
    return by_id


def test_other_numbers_than_the_checkpoints_fail_the_smoke() -> None:
    res = _result(transformers="5.24.0")
    res["numbers"].update(
        tensors_differ=2, tensors_differ_names=["transformer.h.0.attn.c_proj.weight"],
        buffers_differ=1, buffers_differ_names=["transformer.h.0.attn.logn_tensor"],
    )
    findings, summary = evaluate(ChildOutcome(result=res), SmokeOptions(), "/ckpt")
    f = {f.id: f for f in findings}["smoke.numbers"]
    assert f.severity is Severity.FAIL and summary["ok"] is False
    assert "c_proj.weight" in f.message and "logn_tensor" in f.message
    assert "qwen-kvprep fix /ckpt" in str(f.fix)


def test_healthy_result_passes_with_measurements() -> None:
    out = ChildOutcome(result=_result())
    findings, summary = evaluate(out, SmokeOptions(), "/ckpt")
    assert all(f.severity in (Severity.OK, Severity.INFO) for f in findings), findings
    assert summary["ok"] is True
    kv = summary["kv_bytes_per_token"]
    assert kv["quantized"] == 2 * 2 * 2 * 132
    assert kv["unquantized"] == 2 * 2 * 2 * 256
    assert kv["ratio"] == pytest.approx(132 / 256)
    assert kv["expected_ratio"] == pytest.approx(132 / 256)
    assert summary["kernel_layers"] == 2
    assert "16/16" in {f.id: f for f in findings}["smoke.agreement"].message
    assert "0.516x" in {f.id: f for f in findings}["smoke.measure"].message


def test_fallback_layer_fails_and_quotes_the_warning() -> None:
    warning = FALLBACK_WARNINGS[0]
    res = _result(layers=[_layer(0), _layer(1, loaded=False)], load_warnings=[warning])
    f = _judge(res)["smoke.kernel"]
    assert f.severity is Severity.FAIL
    assert warning in f.message
    assert "1 of 2 layers fell back" in f.message
    assert f.details["fallback_layers"] == ["transformer.h.1.attn"]
    assert "qwen-kvprep fix" in (f.fix or "")


def test_fallback_warning_found_in_printed_output_too() -> None:
    res = _result(layers=[_layer(0, loaded=False), _layer(1, loaded=False)])
    f = _judge(res, log_tail=[f"UserWarning: {FALLBACK_WARNINGS[1]}"])["smoke.kernel"]
    assert f.severity is Severity.FAIL
    assert FALLBACK_WARNINGS[1] in f.message and "all 2 layers" in f.message


def test_pure_python_stand_in_is_not_the_kernel() -> None:
    f = _judge(_result(layers=[_layer(0, compiled=False), _layer(1)]))["smoke.kernel"]
    assert f.severity is Severity.FAIL
    assert "not a compiled extension" in f.message


def test_kernel_that_is_never_called_fails() -> None:
    f = _judge(_result(layers=[_layer(0, calls=0), _layer(1)]))["smoke.kernel"]
    assert f.severity is Severity.FAIL and "never called" in f.message


def _fast(own_tokens: Optional[list[int]] = None, fast_steps: int = 0, **over: Any) -> Any:
    """A result whose quantized run went through the fast path in both layers, and the
    same generation by the model's own Int8 code (`own_tokens`, None: not run)."""
    layers = [dict(_layer(i), fast_path_installed=True, fast_steps=16) for i in range(2)]
    res = _result(layers=layers, **over)
    if own_tokens is not None:
        tokens = res["quantized"]["tokens"]
        diverged = next((i for i, (a, b) in enumerate(zip(tokens, own_tokens)) if a != b), None)
        res["own_code"] = {
            "tokens": own_tokens,
            "fast_steps": fast_steps,
            "comparison": dict(res["comparison"], first_divergence=diverged),
        }
    return _judge(res)["smoke.fast_path"]


def test_the_fast_path_passes_where_it_gives_the_model_s_own_tokens() -> None:
    f = _fast(list(range(10, 26)))
    assert f.severity is Severity.OK
    assert "the same 16 greedy tokens as the model's own Int8 code" in f.message
    assert "logits within 0.15" in f.message  # the made-up comparison's difference


def test_the_fast_path_fails_where_the_model_s_own_int8_code_gives_other_tokens() -> None:
    """The unquantized run may agree within its tolerance; the fast path stands in for the
    model's own Int8 code and must give its tokens exactly."""
    own = list(range(10, 26))
    own[5] = 999
    f = _fast(own)
    assert f.severity is Severity.FAIL
    assert "does not reproduce this model's own Int8 code" in f.message
    assert "from token 6 of 16" in f.message
    assert "qwen-kvprep fix /ckpt" in str(f.fix) and "--no-fast-path" in str(f.fix)
    assert f.details["own_code"]["tokens"] == own


def test_a_fast_path_that_cannot_be_set_aside_fails() -> None:
    f = _fast(list(range(10, 26)), fast_steps=32)
    assert f.severity is Severity.FAIL and "could not be set aside" in f.message


def test_per_token_prefill_is_not_compared_with_the_model_s_own_code() -> None:
    f = _fast(None, per_token_prefill=True)
    assert f.severity is Severity.OK and "not compared" in f.message


def test_the_child_reads_per_token_prefill_from_the_planted_fast_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """fix --per-token-prefill plants a fast path that quantizes prompts with other numbers
    than the model's own: the child then leaves the comparison out, and says so."""
    import types

    from qwen_kvprep.smoke.child import per_token_prefill

    package = "transformers_modules.tiny.0123abcd"
    layer = type("QWenAttention", (), {"__module__": f"{package}.modeling_qwen"})()
    layers: Any = [("transformer.h.0.attn", layer)]
    assert per_token_prefill(layers) is False  # no fast path imported
    planted = types.SimpleNamespace(PER_TOKEN_PREFILL=False)
    monkeypatch.setitem(sys.modules, f"{package}.qwen_kvprep_kv", planted)
    assert per_token_prefill(layers) is False
    planted.PER_TOKEN_PREFILL = True
    assert per_token_prefill(layers) is True


def test_quantization_off_fails_and_skips_the_rest() -> None:
    layers = [dict(_layer(i), use_cache_quantization=False) for i in range(2)]
    q = dict(_result()["quantized"], enabled=False, cache=_ucache())
    by = _judge(_result(layers=layers, quantized=q))
    assert by["smoke.quantization"].severity is Severity.FAIL
    assert by["smoke.kernel"].severity is Severity.SKIP
    assert by["smoke.agreement"].severity is Severity.SKIP
    # the "quantized" run ran the unquantized cache: its speed is not called quantized
    measure = by["smoke.measure"]
    assert "quantized," not in measure.message and "tokens/s quantized" not in measure.message
    assert "300 tokens/s unquantized" in measure.message
    assert "the quantized cache is off" in measure.message
    assert measure.details["tokens_per_s"]["quantized"] is None


def test_cache_that_is_not_uint8_per_token_fails() -> None:
    cache = _qcache()
    cache["layers"][1] = dict(cache["layers"][1], scale_shape=[1, 2, 1, 1], per_token=False)
    q = dict(_result()["quantized"], cache=cache)
    f = _judge(_result(quantized=q))["smoke.quantization"]
    assert f.severity is Severity.FAIL and "per token" in f.message


def test_logit_difference_over_threshold_fails() -> None:
    cmp_ = dict(_result()["comparison"], max_rel_logit_diff=MAX_REL_LOGIT_DIFF * 1.5)
    f = _judge(_result(comparison=cmp_))["smoke.agreement"]
    assert f.severity is Severity.FAIL
    assert f.details["threshold_rel_logit_diff"] == MAX_REL_LOGIT_DIFF


def test_divergence_at_a_near_tie_is_accepted() -> None:
    cmp_ = dict(
        _result()["comparison"],
        identical_tokens=11,
        first_divergence=9,
        divergence_margin=0.05,
        divergence_rel_margin=0.0025,
    )
    f = _judge(_result(comparison=cmp_))["smoke.agreement"]
    assert f.severity is Severity.OK
    assert "first 9/16" in f.message and "near-tie" in f.message


def test_divergence_with_a_clear_margin_fails() -> None:
    cmp_ = dict(
        _result()["comparison"],
        identical_tokens=0,
        first_divergence=0,
        divergence_margin=4.0,
        divergence_rel_margin=0.2,
    )
    f = _judge(_result(comparison=cmp_))["smoke.agreement"]
    assert f.severity is Severity.FAIL
    assert "token 1" in f.message and "0/16" in f.message


def test_ratio_off_the_formula_is_a_warning() -> None:
    q = dict(_result()["quantized"])
    q["cache"] = dict(q["cache"], bytes_per_token=q["cache"]["bytes_per_token"] + 64)
    f = _judge(_result(quantized=q))["smoke.measure"]
    assert f.severity is Severity.WARN and "predicts 0.516x" in f.message


@pytest.mark.parametrize(
    ("command", "extra", "option"),
    [("smoke", ["--device", "cpu"], "--timeout"), ("fix", ["--no-build"], "--smoke-timeout")],
)
def test_timeout_advice_is_the_command_that_ran_with_its_own_option(
    isolated_hf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    command: str, extra: list[str], option: str,
) -> None:
    """smoke takes --timeout, fix --smoke-timeout: the advice after a timeout reruns the
    command as it was given, with twice the time."""
    import qwen_kvprep.smoke as smoke_pkg
    from qwen_kvprep.tiny import generate_checkpoint
    from tests.cli import invoke

    ckpt = generate_checkpoint(tmp_path / "tiny")
    monkeypatch.setattr(smoke_pkg, "run_child", lambda *_a, **_k: ChildOutcome(
        result=None, timed_out=True, phase="load"))
    res = invoke(command, str(ckpt), *extra, option, "7", "--json")
    f = {f["id"]: f for f in document(res)["findings"]}["smoke.load"]
    assert f["details"]["timed_out"] is True
    found = check_advice(f["fix"], models=[ckpt])
    assert shlex.join(["qwen-kvprep", command, str(ckpt), *extra, option, "14"]) in found


def test_timeout_during_load_is_a_load_failure() -> None:
    f = _judge(None, timed_out=True, phase="load", log_tail=["Loading ..."])["smoke.load"]
    assert f.severity is Severity.FAIL
    assert "30 s" in f.message and "loading the model" in f.message
    assert f.details["timed_out"] is True
    assert "Loading ..." in f.message
    # the advice names the option of the command that ran the smoke, and it parses
    assert check_advice(str(f.fix)) == ["qwen-kvprep doctor /ckpt",
                                        "qwen-kvprep smoke /ckpt --timeout 60"]
    out = ChildOutcome(result=None, timed_out=True, phase="load")
    options = SmokeOptions(timeout=900, rerun=("qwen-kvprep fix /ckpt --no-fast-path",
                                               "--smoke-timeout"))
    (f,), _ = evaluate(out, options, "/ckpt")
    assert "`qwen-kvprep fix /ckpt --no-fast-path --smoke-timeout 1800`" in str(f.fix)
    check_advice(str(f.fix), models=["/ckpt"])


def test_error_event_is_quoted_with_its_phase() -> None:
    err = {"phase": "generate-quantized", "type": "RuntimeError", "message": "CUDA error: boom"}
    f = _judge(None, error=err, returncode=1, phase="generate-quantized")["smoke.run"]
    assert f.severity is Severity.FAIL
    assert "RuntimeError while generating with the quantized cache: CUDA error: boom" in f.message


def test_known_error_gets_its_specific_fix() -> None:
    err = {
        "phase": "load",
        "type": "FileNotFoundError",
        "message": "[Errno 2] No such file or directory: './cache_autogptq_cuda_256.cpp'",
    }
    f = _judge(None, error=err, returncode=1)["smoke.load"]
    assert "relative to the working directory" in (f.fix or "")


def test_crash_by_signal_is_named() -> None:
    f = _judge(None, returncode=-signal.SIGSEGV, phase="generate-unquantized")["smoke.run"]
    assert "SIGSEGV" in f.message


def test_state_entry_keeps_the_verdict_not_the_text() -> None:
    _, summary = evaluate(ChildOutcome(result=_result()), SmokeOptions(), "/ckpt")
    entry = state_entry(summary)
    assert entry["ok"] is True
    assert entry["kv_bytes_per_token"]["ratio"] == pytest.approx(132 / 256)
    assert "text" not in entry and "checked" in entry
    json.dumps(entry)


# -- the runner, with stand-in children ---------------------------------------------------


def _stand_in(monkeypatch: pytest.MonkeyPatch, code: str) -> None:
    def command(directory: Path, options: SmokeOptions, fd: int) -> list[str]:
        return [sys.executable, "-c", textwrap.dedent(code), str(fd)]

    monkeypatch.setattr(runner_mod, "child_command", command)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_timeout_kills_the_whole_process_group(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pidfile = tmp_path / "grandchild.pid"
    _stand_in(
        monkeypatch,
        f"""
        import os, subprocess, sys, time
        out = os.fdopen(int(sys.argv[1]), "w")
        out.write('{{"event": "phase", "phase": "load"}}\\n'); out.flush()
        # a grandchild that ignores SIGTERM, like a wedged compiler
        g = subprocess.Popen([sys.executable, "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
        open({str(pidfile)!r}, "w").write(str(g.pid))
        print("about to hang", file=sys.stderr, flush=True)
        time.sleep(600)
        """,
    )
    t0 = time.monotonic()
    out = run_child(tmp_path, SmokeOptions(timeout=3))
    elapsed = time.monotonic() - t0
    assert out.timed_out and out.phase == "load"
    assert elapsed < 3 + 8
    assert out.log_tail[-1] == "about to hang"
    grandchild = int(pidfile.read_text())
    for _ in range(50):  # it is killed, then reaped by init
        if not _alive(grandchild):
            break
        time.sleep(0.1)
    assert not _alive(grandchild)
    with pytest.raises(ProcessLookupError):
        os.killpg(out.pid or 0, 0)


def test_result_survives_noise_on_stdout_and_a_bad_exit(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _stand_in(
        monkeypatch,
        """
        import os, sys
        out = os.fdopen(int(sys.argv[1]), "w")
        print('{"event": "result", "result": {"fake": 1}}')  # on stdout: must be ignored
        out.write('not json\\n')
        out.write('{"event": "result", "result": {"real": 1}}\\n'); out.flush()
        os._exit(3)
        """,
    )
    out = run_child(tmp_path, SmokeOptions(timeout=30))
    assert out.result == {"real": 1}
    assert out.returncode == 3 and out.bad_lines == 1 and not out.timed_out


def test_a_child_leaves_at_once_with_its_result_its_output_and_its_code(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """exit_child skips the interpreter's teardown (an atexit handler stands for it), not
    the result, the exit code or the last thing the child printed."""
    teardown = tmp_path / "teardown-ran"
    _stand_in(
        monkeypatch,
        f"""
        import atexit, sys
        from qwen_kvprep.childproc import child_main, exit_child
        atexit.register(lambda: open({str(teardown)!r}, "w").close())
        def work(ev):
            sys.stdout.write("printed without a newline")
            return {{"real": 1}}
        exit_child(child_main(int(sys.argv[1]), work))
        """,
    )
    out = run_child(tmp_path, SmokeOptions(timeout=60))
    assert out.result == {"real": 1} and out.returncode == 0 and not out.timed_out
    assert out.log_tail[-1:] == ["printed without a newline"], out.log_tail
    assert not teardown.exists()


def test_a_failing_progress_display_is_reported_once_and_the_run_goes_on(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _stand_in(
        monkeypatch,
        """
        import os, sys
        out = os.fdopen(int(sys.argv[1]), "w")
        for phase in ("load", "generate-quantized", "generate-unquantized"):
            out.write('{"event": "phase", "phase": "%s"}\\n' % phase)
        out.write('{"event": "result", "result": {"real": 1}}\\n'); out.flush()
        """,
    )
    calls: list[str] = []

    def broken(phase: str) -> None:
        calls.append(phase)
        raise KeyError(phase)

    with pytest.warns(RuntimeWarning) as warned:
        out = run_child(tmp_path, SmokeOptions(timeout=30), broken)
    assert out.result == {"real": 1} and out.returncode == 0
    assert calls == ["load"]  # not called again after it failed
    (warning,) = [str(w.message) for w in warned]
    assert "the progress display failed (KeyError: 'load')" in warning


def test_crash_keeps_the_last_phase_and_output(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _stand_in(
        monkeypatch,
        """
        import os, signal, sys
        out = os.fdopen(int(sys.argv[1]), "w")
        out.write('{"event": "phase", "phase": "generate-quantized"}\\n'); out.flush()
        print("CUDA error: an illegal memory access was encountered", file=sys.stderr)
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGSEGV)
        """,
    )
    out = run_child(tmp_path, SmokeOptions(timeout=30))
    findings, _ = evaluate(out, SmokeOptions(timeout=30), str(tmp_path))
    (f,) = findings
    assert f.id == "smoke.run" and "SIGSEGV" in f.message
    assert "illegal memory access" in f.message


def test_tail_lines_reduces_progress_bars(tmp_path: Path) -> None:
    log = tmp_path / "log"
    log.write_bytes(b"a\n 10%\r 50%\r100%\n\nlast\n")
    assert tail_lines(log) == ["a", "100%", "last"]


def test_child_reports_an_unusable_directory(tmp_path: Path) -> None:
    # the real child, no model: from_pretrained fails and the error comes back quoted
    out = run_child(tmp_path, SmokeOptions(timeout=120, device="cpu"))
    findings, summary = evaluate(out, SmokeOptions(timeout=120), str(tmp_path))
    (f,) = findings
    assert f.id == "smoke.load" and f.severity is Severity.FAIL
    assert f.details["exception"]["type"] in ("OSError", "ValueError", "EnvironmentError")
    assert summary["ok"] is False


def test_what_is_not_the_cache_s_fault_is_said_before_the_child(tmp_path: Path) -> None:
    """Another family's folder, an empty prompt and a GPU that is not there are refused up
    front, with nothing recorded: the child would fail with a traceback and the failure
    would replace a passing verdict in the state."""
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama"}))
    res = kvprep("smoke", str(llama), timeout=120)
    assert res.returncode == 1 and 'model_type "llama"' in res.stderr, res.stderr
    assert "Traceback" not in res.stdout + res.stderr
    res = kvprep("smoke", str(llama), "--prompt", "  ", timeout=120)
    assert res.returncode == 2 and "the prompt is empty" in res.stderr
    import torch

    from qwen_kvprep.tiny import generate_checkpoint

    if not torch.cuda.is_available():
        qwen = tmp_path / "qwen"
        generate_checkpoint(qwen)
        res = kvprep("smoke", str(qwen), "--device", "cuda", timeout=120)
        assert res.returncode == 2 and "sees no GPU" in res.stderr, res.stderr
        assert "--device cpu" in res.stderr and "Traceback" not in res.stderr
        assert not (qwen / ".qwen-kvprep").exists()


# -- the real thing on generated checkpoints (CPU build of the extension) ------------------


def cli(*args: str, timeout: float = 300) -> tuple[int, dict[str, Any], str]:
    res = kvprep(*args, timeout=timeout)
    return res.returncode, document(res), res.stderr


def _fixed(dest: Path, smoke: bool = False, **knobs: Any) -> dict[str, Any]:
    from qwen_kvprep.tiny import generate_checkpoint

    generate_checkpoint(dest, **knobs)
    args = ["fix", str(dest), "--json"] + ([] if smoke else ["--no-smoke"])
    rc, doc, err = cli(*args)
    assert rc == 0, (doc, err)
    return doc


def _by_id(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f["id"]: f for f in doc["findings"]}


@pytest.mark.slow
def test_fixed_checkpoint_passes_with_the_kernel_in_every_layer(
    isolated_hf: Path, tmp_path: Path
) -> None:
    ckpt = tmp_path / "tiny"
    doc = _fixed(ckpt, smoke=True)  # fix runs smoke as its last step
    by = _by_id(doc)
    for fid in ("smoke.load", "smoke.quantization", "smoke.kernel", "smoke.agreement"):
        assert by[fid]["severity"] == "ok", by[fid]
    smoke = doc["smoke"]
    assert smoke["ok"] is True and smoke["layers"] == 2 and smoke["kernel_layers"] == 2
    assert all(p.endswith(".so") for p in smoke["kernel_files"])
    kv = smoke["kv_bytes_per_token"]
    # 2 layers x K and V x 2 heads x (128 codes + bf16 scale + bf16 zero)
    assert kv["quantized"] == 2 * 2 * 2 * 132
    assert kv["unquantized"] == 2 * 2 * 2 * 256
    assert kv["ratio"] == pytest.approx(132 / 256) and round(kv["ratio"], 3) == 0.516
    assert smoke["agreement"]["identical_tokens"] == smoke["agreement"]["tokens"] == 16
    # the fast path ran, and gave the tokens of the model's own Int8 code
    fast = by["smoke.fast_path"]
    assert fast["severity"] == "ok" and "the same 16 greedy tokens" in fast["message"], fast
    assert smoke["tokens_per_s"]["quantized"] > 0 and smoke["peak_memory"]["bytes"] > 0
    # the verdict is in the state
    state = json.loads((ckpt / ".qwen-kvprep" / "state.json").read_text())
    assert state["smoke"]["ok"] is True
    assert state["smoke"]["kv_bytes_per_token"]["ratio"] == pytest.approx(132 / 256)

    # and `smoke` alone, human output
    res = kvprep("smoke", str(ckpt), "--max-new-tokens", "4", timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "ran in all 2 layers" in res.stdout and "1,056 bytes instead of 2,048" in res.stdout
    # stderr is not a terminal: a log line a phase, not the terminal's display
    assert "smoke [" not in res.stderr
    assert "s] smoke: loading the model ..." in res.stderr, res.stderr
    assert "s] smoke: generating with the quantized cache ..." in res.stderr


@pytest.mark.slow
def test_other_shape_follows_the_formula(isolated_hf: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "tiny64"
    _fixed(ckpt, head_dim=64, dtype="fp32", layers=3)
    rc, doc, err = cli("smoke", str(ckpt), "--json", "--max-new-tokens", "8")
    assert rc == 0, (doc, err)
    kv = doc["smoke"]["kv_bytes_per_token"]
    # fp32 model through fix's fast path: scale and zero kept in fp16, as the kernels take
    # them (the model's own code keeps them fp32); (64 + 2*2) / (64 * 4)
    assert kv["quantized"] == 3 * 2 * 2 * (64 + 4)
    assert kv["unquantized"] == 3 * 2 * 2 * 64 * 4
    assert kv["ratio"] == pytest.approx(expected_ratio(64, 2, 4)) == pytest.approx(68 / 256)
    assert kv["expected_ratio"] == pytest.approx(kv["ratio"])


def _module_folder(doc: dict[str, Any]) -> Path:
    return Path(doc["modules"]["folder"])


@pytest.mark.slow
def test_missing_sources_in_modules_cache_fail_with_the_fallback_named(
    isolated_hf: Path, tmp_path: Path
) -> None:
    ckpt = tmp_path / "tiny"
    doc = _fixed(ckpt)
    folder = _module_folder(doc)
    for name in ("cache_autogptq_cuda_256.cpp", "cache_autogptq_cuda_kernel_256.cu"):
        (folder / name).unlink()
    # the folder's compatibility module gives the layers the extension without them
    rc, doc, _ = cli("smoke", str(ckpt), "--json", "--max-new-tokens", "4")
    assert rc == 0 and _by_id(doc)["smoke.kernel"]["severity"] == "ok", doc
    # a loader it does not recognise as qwen-kvprep's (an older one, edited) cannot
    loader = ckpt / "cpp_kernels.py"
    text = loader.read_text(encoding="utf-8")
    loader.write_text(text.replace("# qwen-kvprep loader", "# a loader", 1), encoding="utf-8")
    rc, doc, _ = cli("smoke", str(ckpt), "--json", "--max-new-tokens", "4")
    assert rc == 1
    f = _by_id(doc)["smoke.kernel"]
    assert f["severity"] == "fail"
    assert "KV cache kernel source files (.cpp and .cu) not found." in f["message"]
    assert "all 2 layers fell back" in f["message"]
    assert "qwen-kvprep fix" in f["fix"]
    assert doc["smoke"]["kernel_layers"] == 0


@pytest.mark.slow
def test_a_fast_path_that_gives_other_numbers_than_the_model_s_code_fails(
    isolated_hf: Path, tmp_path: Path
) -> None:
    """The fast path planted beside the model's code made to give other numbers (as it
    would, run in place of attention code it does not reproduce): the model's own Int8
    code, run with the fast path set aside, gives other tokens, and the smoke fails."""
    ckpt = tmp_path / "tiny"
    doc = _fixed(ckpt, dtype="fp32")
    planted = _module_folder(doc) / "qwen_kvprep_kv.py"
    text = planted.read_text(encoding="utf-8")
    output = "return layer.c_proj(context),"
    assert text.count(output) == 1
    planted.write_text(text.replace(output, "return layer.c_proj(-4 * context),"),
                       encoding="utf-8")
    # in the checkpoint too, and recorded in the loader as fix records it (else a load
    # takes the checkpoint's own module in place of one that is not the version fix wrote)
    (ckpt / "qwen_kvprep_kv.py").write_bytes(planted.read_bytes())
    loader = ckpt / "cpp_kernels.py"
    recorded = hashlib.sha256(text.encode("utf-8")).hexdigest()
    changed = hashlib.sha256(planted.read_bytes()).hexdigest()
    loader_text = loader.read_text(encoding="utf-8")
    assert loader_text.count(recorded) == 1
    loader.write_text(loader_text.replace(recorded, changed), encoding="utf-8")
    rc, doc, err = cli("smoke", str(ckpt), "--json")
    f = _by_id(doc)["smoke.fast_path"]
    assert f["severity"] == "fail", (f, err)
    assert "does not reproduce this model's own Int8 code" in f["message"]
    assert f["details"]["own_code"]["fast_steps"] == 0
    assert rc == 1


@pytest.mark.slow
def test_model_code_that_raises_fails_with_the_error_quoted(
    isolated_hf: Path, tmp_path: Path
) -> None:
    ckpt = tmp_path / "tiny"
    _fixed(ckpt)
    patch_modeling(ckpt, 'raise RuntimeError("tiny attention refuses to start (test)")')
    rc, doc, err = cli("smoke", str(ckpt), "--json")
    assert rc == 1 and "Traceback" not in err
    (f,) = doc["findings"]
    assert f["id"] == "smoke.load" and f["severity"] == "fail"
    assert "RuntimeError" in f["message"]
    assert "tiny attention refuses to start (test)" in f["message"]


@pytest.mark.slow
def test_hang_is_cut_at_the_timeout(isolated_hf: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "tiny"
    _fixed(ckpt)
    patch_modeling(ckpt, "import time; time.sleep(600)")
    timeout = 10.0  # the child is loading the model well before this, even on a busy machine
    t0 = time.monotonic()
    rc, doc, _ = cli("smoke", str(ckpt), "--json", "--timeout", str(timeout), timeout=120)
    elapsed = time.monotonic() - t0
    assert rc == 1
    (f,) = doc["findings"]
    assert f["id"] == "smoke.load" and f["details"]["timed_out"] is True
    assert f"{timeout:g} s" in f["message"]
    # CLI start-up and the SIGTERM grace come on top of the timeout
    assert elapsed < timeout + 10, elapsed


def _gone(pid: int) -> bool:
    """Dead: no such process, or a zombie nobody reaped yet."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return not _alive(pid)
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_a_child_dies_with_its_parent_killed_outright(tmp_path: Path) -> None:
    """SIGKILL the process running the child (as a killed fix): the child, in its own
    session, must not go on loading a model with nobody to stop it."""
    pidfile = tmp_path / "child.pid"
    child = (
        "import os, sys, time\n"
        "from qwen_kvprep.childproc import child_main\n"
        f"open({str(pidfile)!r}, 'w').write(str(os.getpid()))\n"
        "child_main(int(sys.argv[1]), lambda ev: time.sleep(600))\n"
    )
    parent = (
        "import sys\n"
        "from qwen_kvprep.childproc import run_events_child\n"
        f"run_events_child(lambda fd: [sys.executable, '-c', {child!r}, str(fd)], 600)\n"
    )
    import subprocess

    from qwen_kvprep.childproc import child_env

    proc = subprocess.Popen([sys.executable, "-c", parent], env=child_env())
    try:
        for _ in range(600):  # the child started and is past child_main's first line
            if pidfile.exists() and pidfile.read_text():
                break
            assert proc.poll() is None, "the parent ended on its own"
            time.sleep(0.1)
        pid = int(pidfile.read_text())
        assert not _gone(pid)
    finally:
        proc.kill()
        proc.wait()
    for _ in range(300):
        if _gone(pid):
            break
        time.sleep(0.1)
    else:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)  # leave nothing behind
        pytest.fail("the child outlived its killed parent")
