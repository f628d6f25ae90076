"""convert's proof (qwen_kvprep.convert.verify): the original through its own code against
the converted folder as Qwen2ForCausalLM, in a child process.

The converted folders are written by convert itself (tests/convert_kit.py).
"""

from __future__ import annotations

import ast
import os
import shlex
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from qwen_kvprep.childproc import ChildOutcome
from qwen_kvprep.convert import context as ctx
from qwen_kvprep.convert.serving import commands
from qwen_kvprep.convert.verify import VerifyResult, judge, verify
from qwen_kvprep.convert.verify_protocol import VerifyChildResult
from qwen_kvprep.findings import Finding, Severity
from qwen_kvprep.tiny import REMOTE_FILES, generate_checkpoint
from tests import needs
from tests.convert_kit import converted, corrupt
from tests.remote_code import QWEN_CODE_ENV, transformers_release
from tests.treesnap import snapshot

SEQ = 64  # a short trained context, so 4x of it is cheap on a CPU


def _tiny(root: Path, dtype: str, **kw: object) -> Path:
    overrides = {"seq_length": SEQ}
    return generate_checkpoint(root / f"Tiny-{dtype}", dtype=dtype, shards=2,
                               config_overrides=overrides, **kw)  # type: ignore[arg-type]


def _needs_qwen2() -> None:
    if transformers_release() < (4, 37):
        needs.skip("transformers-4.37", "this transformers has no Qwen2ForCausalLM")


def _by_id(result: VerifyResult, id: str) -> list[Finding]:
    return [f for f in result.checks if f.id == id]


@pytest.fixture(scope="module")
def fp32(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    _needs_qwen2()
    root = tmp_path_factory.mktemp("verify32")
    src = _tiny(root, "fp32")
    yield src, converted(src, root / "out")


@pytest.mark.slow
def test_a_converted_fp32_folder_is_proven_equal_and_dir_is_untouched(
    fp32: tuple[Path, Path],
) -> None:
    src, out = fp32
    before = snapshot(src, digest=True, mtimes=True)
    mode = src.stat().st_mode
    src.chmod(stat.S_IRUSR | stat.S_IXUSR)  # read-only DIR (root ignores it; the snapshot does not)
    try:
        result = verify(src, out, timeout=600, context_factor=None)
    finally:
        src.chmod(mode)
    assert result.ok, "\n".join(result.lines)
    assert snapshot(src, digest=True, mtimes=True) == before
    m = result.measured
    assert m is not None and m["dtype_original"] == m["dtype_converted"] == "float32"
    assert m["weights"]["compared"] > 0 and m["weights"]["differ"] == []
    assert m["logits"]["max_rel"] <= 1e-5 and m["steps"]["max_rel"] <= 1e-5
    assert all(g["original"] == g["converted"] for g in m["greedy"])
    assert len(set(m["prompt_tokens"])) > 1  # a batch of different lengths
    assert "context" not in m
    # every layer ran, one block at a time, and the greedy steps on the whole models
    assert m["fit"]["layers_run"] == m["fit"]["layers_total"] == len(m["blocks"]) == 2
    assert m["compute_dtype"] == "float32" and "greedy_skipped" not in m
    assert result.lines[-1] == "proof: OK"


@pytest.mark.slow
def test_a_converted_bf16_folder_is_proven_equal(tmp_path: Path) -> None:
    _needs_qwen2()
    src = _tiny(tmp_path, "bf16")
    result = verify(src, converted(src, tmp_path / "out"), timeout=600, context_factor=None)
    assert result.ok, "\n".join(result.lines)
    assert result.measured is not None and result.measured["dtype_converted"] == "bfloat16"


@pytest.mark.slow
@pytest.mark.parametrize("how", ["weight", "swap-qk"])
def test_a_corrupted_folder_fails_naming_the_tensor(
    fp32: tuple[Path, Path], tmp_path: Path, how: str
) -> None:
    src, good = fp32
    out = tmp_path / "out"
    shutil.copytree(good, out)
    name = corrupt(out, how)
    result = verify(src, out, timeout=600, context_factor=None)
    assert not result.ok
    (weights,) = _by_id(result, "verify.weights")
    assert weights.severity is Severity.FAIL and name in weights.message
    if how == "swap-qk":
        assert "k_proj.weight" in weights.message
    # the numbers show it too, not only the tensor comparison
    assert any(f.severity is Severity.FAIL for f in _by_id(result, "verify.logits"))
    assert result.lines[-1] == "proof: FAILED"
    assert any(name in line for line in result.lines)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["swap-qk", "scale-o-last"])
def test_the_block_by_block_proof_names_the_block_where_the_models_part(
    fp32: tuple[Path, Path], tmp_path: Path, how: str
) -> None:
    src, good = fp32
    out = tmp_path / "out"
    shutil.copytree(good, out)
    name = corrupt(out, how)
    result = verify(src, out, timeout=600, context_factor=None)
    assert not result.ok and result.lines[-1] == "proof: FAILED"
    (weights,) = _by_id(result, "verify.weights")
    assert weights.severity is Severity.FAIL and name in weights.message
    (blocks,) = _by_id(result, "verify.blocks")
    layer = int(name.split(".")[2])  # 0 for the swap, the last (1) for the scaled o_proj
    assert blocks.severity is Severity.FAIL
    assert f"part after block {layer} of 2" in blocks.message
    m = result.measured
    assert m is not None and len(m["blocks"]) == 2
    assert all(d["max_rel"] <= 1e-5 for d in m["blocks"][:layer])  # before it: equal
    assert any(f.severity is Severity.FAIL for f in _by_id(result, "verify.logits"))


@pytest.mark.slow
def test_a_proof_that_runs_out_of_time_says_so(fp32: tuple[Path, Path]) -> None:
    src, out = fp32
    result = verify(src, out, timeout=0.5, context_factor=None)
    assert not result.ok
    (f,) = result.checks
    assert f.id == "verify.timeout" and "did not finish within 0.5 s" in f.message
    assert "--no-verify" in (f.fix or "")


@pytest.mark.slow
def test_layers_that_do_not_fit_are_named_as_skipped(fp32: tuple[Path, Path]) -> None:
    src, out = fp32
    phases: list[str] = []
    result = verify(src, out, timeout=600, context_factor=None, layers=1,
                    on_phase=phases.append)
    # after the last block the heads run: the progress says so, not "block 1/1" still
    assert phases[phases.index("block 1/1") + 1].startswith("running both models' heads")
    assert result.ok, "\n".join(result.lines)
    (fit,) = _by_id(result, "verify.fit")
    assert "first 1 of 2 layers" in fit.message
    assert "layers 1-1 were not run" in fit.message


@pytest.mark.slow
@pytest.mark.parametrize("rope_type", ["dynamic", "yarn"])
def test_the_context_past_seq_length_is_measured(
    fp32: tuple[Path, Path], tmp_path: Path, rope_type: str
) -> None:
    src, _ = fp32
    out = converted(src, tmp_path / "out", context_factor=4.0, rope_scaling=rope_type)
    result = verify(src, out, timeout=600, context_factor=4.0)
    # the weights and the architecture are proven with the scaling set aside ...
    assert result.ok, "\n".join(result.lines)
    assert result.measured is not None
    assert result.measured["logits"]["max_rel"] <= 1e-5
    (aside,) = _by_id(result, "verify.scaling")
    assert f"rope_scaling {rope_type} factor 4.0" in aside.message
    # ... and what it changes is measured on OUT as it serves
    rows = {r["times"]: r for r in result.measured["context"]["rows"]}
    assert [r["tokens"] for r in rows.values()] == [SEQ, 2 * SEQ, 4 * SEQ]
    within = rows[1.0]["max_abs"]
    assert within is not None
    if rope_type == "dynamic":
        assert within < 1e-4  # dynamic scaling changes nothing within seq_length
    else:
        assert within > 1e-3  # YaRN changes every frequency
    for times in (2.0, 4.0):
        row = rows[times]
        assert row["skipped"] is None and row["positions"] > 0
        assert row["max_abs"] is not None and row["max_abs"] > 1e-3  # Qwen's rules differ
        assert row["top1_agreement"] is not None and 0.0 <= row["top1_agreement"] <= 1.0
    text = "\n".join(result.lines)
    assert "at 2x seq_length (128 tokens): max |Δlogit|" in text and "top-1 agreement" in text
    assert "dynamic NTK and logn attention" in text


@pytest.mark.slow
def test_the_exact_default_is_exact_within_seq_length(fp32: tuple[Path, Path]) -> None:
    src, out = fp32  # no rope scaling: max_position_embeddings = seq_length
    result = verify(src, out, timeout=600, context_factor=None, measure_context=True)
    assert result.measured is not None
    row = result.measured["context"]["rows"][0]
    assert row["times"] == 1.0 and row["tokens"] == SEQ
    assert row["max_abs"] is not None and row["max_abs"] < 1e-4 and row["top1_agreement"] == 1.0


@pytest.mark.slow
def test_the_original_runs_qwens_own_code(tmp_path: Path) -> None:
    folder = os.environ.get(QWEN_CODE_ENV)
    if not folder:
        needs.skip("qwen-code", f"{QWEN_CODE_ENV} names no folder holding it")
    _needs_qwen2()
    src = _tiny(tmp_path, "fp32")
    # Qwen's tokenizer fixes its special tokens' ids for the full vocabulary: the tiny
    # one stays
    for name in REMOTE_FILES:
        if name != "tokenization_qwen.py":
            shutil.copyfile(Path(folder) / name, src / name)
    result = verify(src, converted(src, tmp_path / "out"), timeout=600, context_factor=None)
    assert result.ok, "\n".join(result.lines)


@pytest.mark.slow
def test_a_gptq_folder_gives_the_originals_tokens(tmp_path: Path) -> None:
    needs.gptq_backend()
    _needs_qwen2()
    src = generate_checkpoint(
        tmp_path / "Tiny-Int4", gptq=True, config_overrides={"seq_length": SEQ}
    )
    result = verify(src, converted(src, tmp_path / "out"), timeout=900, context_factor=None)
    assert result.ok, "\n".join(result.lines)
    m = result.measured
    assert m is not None and m["gptq"] and m["weights"]["skipped"] is not None
    assert all(g["original"] == g["converted"] for g in m["greedy"])


# -- the judgement, without a model ------------------------------------------------------


def _measured(**changes: object) -> VerifyChildResult:
    diff = {"positions": 10, "max_abs": 1e-7, "max_rel": 1e-8, "scale": 10.0}
    base: dict[str, object] = {
        "result_version": 1, "torch": "2", "transformers": "5", "device": "cpu",
        "dtype_original": "float32", "dtype_converted": "float32", "gptq": False,
        "fit": {"device": "cpu", "layers_total": 2, "layers_run": 2, "weights_bytes": 1,
                "available_bytes": 9, "reason": None},
        "prompt_tokens": [3, 9], "logits": diff, "steps": diff,
        "greedy": [{"prompt": 0, "original": [1, 2], "converted": [1, 2],
                    "first_divergence": None, "margin": None}],
        "weights": {"compared": 5, "differ": [], "skipped": None},
        "tokenizer": {"status": "ok", "message": "fine", "details": None},
        "template": {"status": "ok", "message": "fine", "details": None},
        "seconds": {}, "scaling_set_aside": None,
    }
    base.update(changes)
    return base  # type: ignore[return-value]


def _judge(m: VerifyChildResult) -> VerifyResult:
    return judge(ChildOutcome(result=m), timeout=1, rerun="r")


def test_tokens_may_part_only_at_a_tie_the_dtype_cannot_decide() -> None:
    def parted(margin: float) -> VerifyChildResult:
        return _measured(greedy=[{"prompt": 0, "original": [1, 2], "converted": [1, 3],
                                  "first_divergence": 1, "margin": margin}])

    assert _judge(parted(1e-5)).ok  # 1e-5 <= 1e-5 * scale 10
    bad = _judge(parted(0.5))
    assert not bad.ok
    assert "parts at token 1" in _by_id(bad, "verify.greedy")[0].message


def test_greedy_steps_that_do_not_fit_are_a_skip_and_the_blocks_are_judged() -> None:
    diff = {"positions": 10, "max_abs": 1e-7, "max_rel": 1e-8, "scale": 10.0}
    far = {"positions": 10, "max_abs": 1.0, "max_rel": 0.1, "scale": 10.0}
    m = _measured(blocks=[diff, diff], compute_dtype="float32", greedy=[],
                  greedy_skipped="both whole models need about 34 GiB and 20 GiB are free")
    result = _judge(m)
    assert result.ok, result.lines
    (greedy,) = _by_id(result, "verify.greedy")
    assert greedy.severity is Severity.SKIP and "34 GiB" in greedy.message
    assert _by_id(result, "verify.blocks")[0].severity is Severity.OK
    # bf16 weights computed in float32: float32's tolerance
    bad = _judge(_measured(blocks=[diff, far], compute_dtype="float32",
                           dtype_original="bfloat16", dtype_converted="bfloat16"))
    (blocks,) = _by_id(bad, "verify.blocks")
    assert not bad.ok and "part after block 1 of 2" in blocks.message


def test_logit_tolerance_follows_the_dtype() -> None:
    off = {"positions": 10, "max_abs": 0.1, "max_rel": 0.01, "scale": 10.0}
    assert not _judge(_measured(logits=off)).ok
    bf16 = _measured(logits=off, dtype_original="bfloat16", dtype_converted="bfloat16")
    assert _judge(bf16).ok
    assert not _judge(_measured(dtype_converted="bfloat16")).ok


def test_a_missing_tokenizer_proof_is_a_skip_and_a_failed_one_fails() -> None:
    gone = {"status": "unavailable", "message": "absent", "details": None}
    r = _judge(_measured(tokenizer=gone))
    assert r.ok
    assert _by_id(r, "verify.tokenizer")[0].severity is Severity.SKIP
    broke = {"status": "fail", "message": "3 ids differ", "details": None}
    assert not _judge(_measured(template=broke)).ok


def test_a_child_that_dies_is_reported_with_its_last_words() -> None:
    out: ChildOutcome[VerifyChildResult] = ChildOutcome(
        returncode=-9, phase="load-original", log_tail=["Killed"]
    )
    r = judge(out, timeout=60, rerun="r")
    assert not r.ok and "loading the original through its own code" in r.lines[0]
    assert "  | Killed" in r.lines


def test_context_rows_cover_the_part_they_are_about() -> None:
    assert ctx.rows_to_measure(100) == [(1.0, 100), (2.0, 200), (4.0, 400)]
    where = ctx._positions(4000, 1000)
    assert len(where) <= ctx.MAX_POSITIONS and where[-1] == 3999 and where[0] >= 1000
    assert ctx.long_input([1, 2, 3], 7) == [1, 2, 3, 1, 2, 3, 1]
    assert ctx.original_rules({"use_dynamic_ntk": True, "use_logn_attn": False}) == [
        "dynamic NTK"
    ]


# -- serving -------------------------------------------------------------------------------


def test_serving_commands_name_each_engine_and_its_quantized_cache() -> None:
    got = dict(commands(Path("/m/my model"), gptq=False, max_len=8192))
    text = "\n".join(got.values())
    assert "vllm serve '/m/my model' --max-model-len 8192 --kv-cache-dtype fp8" in text
    assert "--kv-cache-dtype int8_per_token_head" in text
    assert "--kv-cache-dtype fp8_e4m3" in text and "--context-length 8192" in text
    assert "--quant-policy 8" in text and "--session-len 8192" in text
    assert "gptq" not in text and "trust-remote-code" not in text
    program = next(v for k, v in got.items() if k.startswith("transformers"))
    argv = shlex.split(program)
    assert argv[:2] == ["python", "-c"]
    tree = ast.parse(argv[2])
    assert '"/m/my model"' in argv[2] and any(
        isinstance(n, ast.Attribute) and n.attr == "cache_implementation" for n in ast.walk(tree)
    )
    assert "torch.compile" in argv[2]


def test_serving_commands_for_gptq_leave_the_kernel_to_the_engines() -> None:
    got = dict(commands(Path("/m/q"), gptq=True, max_len=2048, bits=4))
    assert not any("--quantization" in v for v in got.values())
    assert any("--model-format gptq" in v for v in got.values())


def test_a_dir_without_its_code_is_a_failed_proof_not_a_traceback(tmp_path: Path) -> None:
    _needs_qwen2()  # before 4.37 the proof stops earlier, at the release
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    result = verify(src, tmp_path / "out", timeout=60, context_factor=None)
    assert not result.ok
    (f,) = result.checks
    assert f.id == "verify.original" and "modeling_qwen.py" in f.message


def test_a_transformers_without_qwen2_is_named_not_a_failed_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.metadata

    real = importlib.metadata.version
    monkeypatch.setattr(
        importlib.metadata, "version", lambda n: "4.32.0" if n == "transformers" else real(n)
    )
    result = verify(tmp_path, tmp_path, timeout=60, context_factor=None)
    assert not result.ok
    (child,) = _by_id(result, "verify.child")
    assert "transformers 4.32.0 cannot load OUT natively" in child.message
    assert child.fix is not None and "--no-verify" in child.fix


# -- failure headlines name their cause; NaN is said, never passed ---------------------------


def test_nan_in_the_original_s_logits_fails_and_is_named() -> None:
    nan = float("nan")
    # what a child reports for NaN logits: NaN everywhere, max_rel 0 (NaN > 0 is false)
    bad = {"positions": 10, "max_abs": nan, "max_rel": 0.0, "scale": nan,
           "nonfinite_original": 3, "nonfinite_converted": 3}
    r = _judge(_measured(logits=bad))
    assert not r.ok
    (f, _) = _by_id(r, "verify.logits")
    assert f.severity is Severity.FAIL and "NaN" in f.message and " ok" not in f.message
    assert r.headline.startswith("logits (padded batch): the original's own logits are NaN")
    assert "does not behave" not in r.headline
    # a child of before the counts: the NaN alone fails
    old = {"positions": 10, "max_abs": nan, "max_rel": 0.0, "scale": nan}
    assert not _judge(_measured(logits=old)).ok


def test_nan_weights_equal_bit_for_bit_are_equal_and_named() -> None:
    import torch

    from qwen_kvprep.convert.verify_child import bits_equal, nan_where

    t = torch.zeros(6, 4)
    t[4, 1] = float("nan")
    assert bits_equal(t.clone(), t) and not bits_equal(t + 1, t)
    assert nan_where("transformer.wte.weight", t) == "transformer.wte.weight: 1 NaN value (row 4)"
    assert nan_where("x", torch.zeros(3)) is None
    r = _judge(_measured(weights={"compared": 5, "differ": [], "skipped": None,
                                  "nan": ["transformer.wte.weight: 1 NaN value (row 4)"]}))
    assert r.ok and r.headline == ""
    (note,) = _by_id(r, "verify.nan")
    assert note.severity is Severity.WARN and "row 4" in note.message


def test_nan_is_counted_piece_by_piece_across_the_pieces_edges(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    from qwen_kvprep.convert import blockproof

    monkeypatch.setattr(blockproof, "_NAN_CHUNK", 5)  # pieces end inside rows
    t = torch.zeros(6, 4, dtype=torch.bfloat16)
    t[0, 0] = t[1, 0] = t[5, 3] = float("nan")  # elements 0, 4 (first piece) and 23 (last)
    assert blockproof.nan_where("w", t) == "w: 3 NaN values (rows 0, 1, 5)"
    assert blockproof.nan_where("w", torch.zeros(6, 4, dtype=torch.bfloat16)) is None


@pytest.mark.slow
def test_an_unused_nan_row_is_proven_equal_and_named(tmp_path: Path) -> None:
    """A NaN in an embedding row no token reaches (the padding past the 720 ids): the
    same bits in OUT, so the proof passes and says where the NaN is."""
    import torch
    from safetensors.torch import load_file, save_file

    _needs_qwen2()
    src = _tiny(tmp_path, "fp32")
    for shard in sorted(src.glob("*.safetensors")):
        tensors = load_file(str(shard))
        if "transformer.wte.weight" in tensors:
            tensors["transformer.wte.weight"][740, 3] = float("nan")
            save_file(tensors, str(shard), metadata={"format": "pt"})
    assert torch.isnan(
        next(load_file(str(p)) for p in sorted(src.glob("*.safetensors"))
             if "transformer.wte.weight" in load_file(str(p)))["transformer.wte.weight"]
    ).any()
    result = verify(src, converted(src, tmp_path / "out"), timeout=600, context_factor=None)
    assert result.ok, "\n".join(result.lines)
    (note,) = _by_id(result, "verify.nan")
    assert "transformer.wte.weight: 1 NaN value (row 740)" in note.message


def test_a_modeling_file_that_is_not_utf8_is_named_as_such(tmp_path: Path) -> None:
    _needs_qwen2()
    src = _tiny(tmp_path, "fp32")
    modeling = src / "modeling_qwen.py"
    modeling.write_bytes(modeling.read_bytes() + b"\n# caf\xe9\n")
    result = verify(src, tmp_path / "out", timeout=60, context_factor=None)
    assert not result.ok
    (f,) = result.checks
    assert "not UTF-8" in f.message and "e9" in f.message
    assert "not UTF-8" in result.headline and "does not behave" not in result.headline
    assert f.fix is not None and "timeout" not in f.fix
    # convert refuses it before it writes anything, rather than after the weights
    from qwen_kvprep.convert.run import ConvertOptions, convert
    from qwen_kvprep.errors import CheckpointError

    with pytest.raises(CheckpointError) as info:
        convert(src, tmp_path / "out", ConvertOptions())
    # (as fix validates the checkpoint: checkpoint.remote_code names the byte and its line)
    said = " ".join([info.value.message, *(f.message for f in info.value.findings)])
    assert "not UTF-8" in said and "0xe9" in said, said
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


@pytest.mark.slow
def test_a_convert_whose_proof_times_out_says_so_first(tmp_path: Path) -> None:
    from qwen_kvprep.convert.run import ConvertOptions, convert
    from qwen_kvprep.errors import RefusedError

    _needs_qwen2()
    src = _tiny(tmp_path, "fp32")
    with pytest.raises(RefusedError) as info:
        convert(src, tmp_path / "out", ConvertOptions(verify_timeout=0.5))
    assert info.value.message.startswith("the proof did not finish in 0.5 s")
    assert "does not behave" not in info.value.message
    assert not (tmp_path / "out").exists()


# -- lines a person reads ----------------------------------------------------------------


def test_the_proof_s_lines_are_short_and_its_details_are_kept() -> None:
    from qwen_kvprep.convert.verify import WIDTH
    from qwen_kvprep.convert.verify_child import _as_proof

    class Said:
        ok = False

        def lines(self) -> list[str]:
            return ["tokenizer: 3 mismatches " + "x" * 150,
                    *(f"  text {i}: " + "ids differ " * 30 for i in range(3))]

        def to_json(self) -> dict[str, object]:
            return {"mismatches": 3}

    proof = _as_proof(Said())
    assert proof["message"].startswith("tokenizer: 3 mismatches") and "text 0" not in proof[
        "message"]
    assert proof["details"] == {"mismatches": 3} and len(proof.get("lines", [])) == 3
    r = _judge(_measured(tokenizer=proof, template={
        "status": "ok", "details": None,
        "message": "chat template: 9 of 9 conversations give make_context's ids and text; "
        + "; ".join(["a documented difference of some length"] * 10)}))
    assert not r.ok
    assert all(len(line) <= WIDTH for line in r.lines), max(r.lines, key=len)
    text = "\n".join(r.lines)
    assert "text 2:" in text  # every line is there, wrapped, not dropped
    (tok,) = _by_id(r, "verify.tokenizer")
    assert tok.details["proof"] == {"mismatches": 3}
