"""`qwen-kvprep plan`: the checkpoint's shape and weights, the prediction, the command."""

from __future__ import annotations

import json
import os
import shutil
import stat
import struct
import sys
from pathlib import Path
from typing import Any

import pytest

from qwen_kvprep import hubcli
from qwen_kvprep.errors import CheckpointError, ConfigError, UsageError
from qwen_kvprep.planning.capacity import (
    Scenario,
    card_peaks,
    make_plan,
    max_batch,
    max_tokens,
    peak,
)
from qwen_kvprep.planning.model import Gptq, model_shape, read_model, weights_from_config
from qwen_kvprep.planning.peak import (
    CUBLAS_WORKSPACE_BYTES,
    CUDA_CONTEXT_BYTES,
    MODES,
    ModelShape,
    fits,
    kv_bytes_per_token,
    predict_peak_bytes,
)
from qwen_kvprep.planning.sizes import parse_int_list, parse_size
from qwen_kvprep.tiny import generate_checkpoint
from tests import needs
from tests.cli import document, invoke, kvprep
from tests.remote_code import with_compat

DATA = Path(__file__).parent / "data"
QWEN_7B = DATA / "qwen-7b-chat-config"
QWEN_7B_INT4 = DATA / "qwen-7b-chat-int4-config"
QWEN_1_8B = DATA / "qwen-1_8b-chat-config"
QWEN_72B = DATA / "qwen-72b-chat-config"
GIB = 1024**3
MIB = 1024**2


def config_only(src: Path, dest: Path) -> Path:
    dest.mkdir()
    shutil.copyfile(src / "config.json", dest / "config.json")
    return dest


def params(layers: int, hidden: int, ff: int, vocab: int) -> int:
    """Qwen v1 parameter count, written independently of weights_from_config: per block
    two norms, QKV with its bias, the output projection and three MLP matrices."""
    block = 2 * hidden + 3 * hidden * hidden + 3 * hidden + hidden * hidden + 3 * hidden * ff
    return 2 * vocab * hidden + layers * block + hidden


# -- shape and weights ----------------------------------------------------------------------


def test_kv_bytes_per_token_is_the_readme_formula() -> None:
    shape = model_shape(QWEN_7B)
    assert kv_bytes_per_token(shape, "unquantized") == 524_288 == 2 * 32 * 32 * 128 * 2
    assert kv_bytes_per_token(shape, "int8") == 270_336 == 2 * 32 * 32 * (128 + 2 * 2)
    fp32 = ModelShape(2, 2, 128, 256, 512, 1000, 4, 0)
    assert kv_bytes_per_token(fp32, "int8") == 2 * 2 * 2 * (128 + 2 * 4)
    with pytest.raises(ValueError):
        kv_bytes_per_token(shape, "int4")


def test_7b_from_index_total_size_without_shards() -> None:
    facts = read_model(QWEN_7B)
    assert facts.shape.weights_bytes == 15_442_649_088
    assert "metadata.total_size" in facts.weights_source
    assert "8 of 8 shards absent" in facts.weights_source
    index = json.loads((QWEN_7B / "model.safetensors.index.json").read_text())
    assert len(index["weight_map"]) == 259
    assert len(set(index["weight_map"].values())) == 8
    shape = model_shape(QWEN_7B)
    assert (shape.layers, shape.heads, shape.head_dim, shape.hidden) == (32, 32, 128, 4096)
    assert (shape.intermediate, shape.vocab, shape.dtype_bytes) == (22016, 151936, 2)
    assert facts.dtype == "bf16" and facts.seq_length == 8192


def test_7b_config_alone_counts_the_same_bytes_as_the_index(tmp_path: Path) -> None:
    facts = read_model(config_only(QWEN_7B, tmp_path / "c"))
    assert facts.shape.weights_bytes == 15_442_649_088 == 2 * params(32, 4096, 11008, 151936)
    assert "counted from config.json" in facts.weights_source


@pytest.mark.parametrize(
    ("folder", "layers", "hidden", "ff", "vocab"),
    [(QWEN_1_8B, 24, 2048, 5504, 151936), (QWEN_72B, 80, 8192, 24576, 152064)],
)
def test_other_sizes_from_config(
    folder: Path, layers: int, hidden: int, ff: int, vocab: int
) -> None:
    facts = read_model(folder)
    assert facts.shape.weights_bytes == 2 * params(layers, hidden, ff, vocab)
    assert facts.shape.head_dim == 128 and facts.shape.layers == layers


def test_dtype_override_and_resolution(tmp_path: Path) -> None:
    assert read_model(QWEN_7B, "fp16").dtype == "fp16"
    d = config_only(QWEN_7B, tmp_path / "none")
    cfg = json.loads((d / "config.json").read_text())
    cfg["bf16"] = False
    (d / "config.json").write_text(json.dumps(cfg))
    assert read_model(d).dtype == "bf16"  # none set: what the remote code picks on Ampere+
    cfg["fp32"] = True
    (d / "config.json").write_text(json.dumps(cfg))
    facts = read_model(d)
    assert facts.dtype == "fp32"
    assert facts.shape.weights_bytes == 4 * params(32, 4096, 11008, 151936)
    cfg["bf16"] = True
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="allows one"):
        read_model(d)
    with pytest.raises(UsageError):
        read_model(QWEN_7B, "int3")


def test_tiny_checkpoint_from_headers(tmp_path: Path) -> None:
    d = generate_checkpoint(tmp_path / "tiny", shards=2)
    facts = read_model(d)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert facts.shape.weights_bytes == index["metadata"]["total_size"]
    assert facts.weights_source == "safetensors headers of 2 files"
    single = generate_checkpoint(tmp_path / "single", shards=1)
    assert read_model(single).weights_source == "model.safetensors header"
    assert read_model(single).shape.weights_bytes == facts.shape.weights_bytes


def test_floating_tensors_are_priced_at_the_load_dtype(tmp_path: Path) -> None:
    d = generate_checkpoint(tmp_path / "fp32", dtype="fp32", shards=1)
    as_stored = read_model(d).shape.weights_bytes
    assert read_model(d, "bf16").shape.weights_bytes * 2 == as_stored


def test_lfs_pointer_shard_falls_back_to_the_index(tmp_path: Path) -> None:
    d = generate_checkpoint(tmp_path / "lfs", shards=2)
    total = json.loads((d / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    shard = d / "model-00001-of-00002.safetensors"
    size = shard.stat().st_size
    shard.write_text(
        f"version https://git-lfs.github.com/spec/v1\noid sha256:{'0' * 64}\nsize {size}\n"
    )
    facts = read_model(d)
    assert facts.shape.weights_bytes == total
    assert "1 of 2 shards are Git LFS pointers (`git lfs pull` fetches them)" in (
        facts.weights_source
    )
    (d / "model-00002-of-00002.safetensors").unlink()
    assert "1 of 2 shards absent" in read_model(d).weights_source


def test_unreadable_header_is_a_clean_error(tmp_path: Path) -> None:
    d = generate_checkpoint(tmp_path / "bad", shards=1)
    (d / "model.safetensors").write_bytes(struct.pack("<Q", 10**12) + b"{}")
    with pytest.raises(CheckpointError, match="not a safetensors file") as info:
        read_model(d)
    assert info.value.fix is not None and "qwen-kvprep doctor" in info.value.fix


def _gptq_tensors(
    layers: int, hidden: int, ff: int, vocab: int, bits: int, group: int
) -> dict[str, Any]:
    """Tensors laid out as AutoGPTQ saves a Qwen checkpoint (zeros: only sizes matter)."""
    import torch

    t: dict[str, Any] = {
        "transformer.wte.weight": torch.zeros(vocab, hidden, dtype=torch.float16),
        "lm_head.weight": torch.zeros(vocab, hidden, dtype=torch.float16),
        "transformer.ln_f.weight": torch.zeros(hidden, dtype=torch.float16),
    }
    for i in range(layers):
        p = f"transformer.h.{i}."
        t[p + "ln_1.weight"] = torch.zeros(hidden, dtype=torch.float16)
        t[p + "ln_2.weight"] = torch.zeros(hidden, dtype=torch.float16)
        for name, n_in, n_out in (
            ("attn.c_attn", hidden, 3 * hidden),
            ("attn.c_proj", hidden, hidden),
            ("mlp.w1", hidden, ff),
            ("mlp.w2", hidden, ff),
            ("mlp.c_proj", ff, hidden),
        ):
            groups = -(-n_in // group)
            t[f"{p}{name}.qweight"] = torch.zeros(n_in // 32 * bits, n_out, dtype=torch.int32)
            t[f"{p}{name}.qzeros"] = torch.zeros(groups, n_out // 32 * bits, dtype=torch.int32)
            t[f"{p}{name}.scales"] = torch.zeros(groups, n_out, dtype=torch.float16)
            t[f"{p}{name}.g_idx"] = torch.zeros(n_in, dtype=torch.int32)
        t[p + "attn.c_attn.bias"] = torch.zeros(3 * hidden, dtype=torch.float16)
    return t


def test_gptq_headers_and_config_agree(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    layers, hidden, ff, vocab = 2, 256, 320, 512  # 320 = 2.5 groups: a partial last group
    d = tmp_path / "gptq"
    d.mkdir()
    cfg = json.loads((QWEN_7B_INT4 / "config.json").read_text())
    cfg.update(
        num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=2,
        intermediate_size=2 * ff, vocab_size=vocab,
    )  # fmt: skip
    (d / "config.json").write_text(json.dumps(cfg))
    counted = read_model(d)
    save_file(_gptq_tensors(layers, hidden, ff, vocab, 4, 128), str(d / "model.safetensors"))
    from_headers = read_model(d)
    assert from_headers.weights_source == "model.safetensors header"
    assert counted.shape.weights_bytes == from_headers.shape.weights_bytes
    assert from_headers.dtype == "fp16" and from_headers.gptq == Gptq(4, 128)


def test_int4_7b_weights_from_config() -> None:
    facts = read_model(QWEN_7B_INT4)
    assert facts.gptq == Gptq(bits=4, group_size=128) and facts.dtype == "fp16"
    dense = 2 * params(32, 4096, 11008, 151936)
    # the embeddings stay 16-bit; the block projections shrink to about a quarter
    assert 0.35 * dense < facts.shape.weights_bytes < 0.40 * dense
    assert facts.shape.weights_bytes == weights_from_config(
        layers=32, heads=32, head_dim=128, hidden=4096, intermediate=22016, vocab=151936,
        dtype_bytes=2, no_bias=True, gptq=Gptq(4, 128),
    )  # fmt: skip


def test_not_qwen_v1_is_refused(tmp_path: Path) -> None:
    d = config_only(QWEN_7B, tmp_path / "q2")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "qwen2"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="Qwen \\(v1\\)"):
        read_model(d)
    cfg["model_type"] = "qwen"
    cfg["num_hidden_layers"] = "32"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        read_model(d)


# -- the prediction ---------------------------------------------------------------------------


def test_decode_peak_is_weights_plus_old_and_new_cache() -> None:
    shape = model_shape(QWEN_7B)
    for mode in MODES:
        got = predict_peak_bytes(shape, 64, 1, 1023, mode)
        # the last step: 1023 cached tokens handed in, 1024 returned, both alive
        core = shape.weights_bytes + 64 * (1023 + 1024) * kv_bytes_per_token(shape, mode)
        extra = got - core
        # what is left: cuBLAS workspace, rotary tables, this step's and the previous
        # step's logits and the fp32 copy (about 77 MiB at batch 64); for Int8 also one
        # layer's transposed key codes (64·32·128·1024 bytes = 256 MiB)
        limit = (360 if mode == "int8" else 100) * MIB
        assert CUBLAS_WORKSPACE_BYTES < extra < limit, (mode, extra)


def test_monotone_in_batch_and_tokens_and_int8_smaller() -> None:
    shape = model_shape(QWEN_7B)
    for mode in MODES:
        by_batch = [predict_peak_bytes(shape, b, 1, 1023, mode) for b in (1, 2, 4, 16, 64)]
        by_tokens = [predict_peak_bytes(shape, 4, 1, n, mode) for n in (0, 1, 511, 4095)]
        assert by_batch == sorted(by_batch) and len(set(by_batch)) == 5
        assert by_tokens == sorted(by_tokens) and len(set(by_tokens)) == 4
    for b in (1, 16, 100):
        assert predict_peak_bytes(shape, b, 1, 2047, "int8") < predict_peak_bytes(
            shape, b, 1, 2047, "unquantized"
        )


def test_long_prompt_prefill_and_chunks() -> None:
    shape = model_shape(QWEN_7B)
    whole = predict_peak_bytes(shape, 1, 8192, 0, "int8")
    chunked = predict_peak_bytes(shape, 1, 8192, 0, "int8", prefill_chunk=512)
    # the Int8 path is eager attention: 32 heads x 8192² scores of 2 bytes, 4 GiB a copy,
    # two copies alive at once
    assert whole - shape.weights_bytes > 8 * GIB
    assert chunked - shape.weights_bytes < (whole - shape.weights_bytes) / 2
    # unquantized attention is fused: no score tensor; the logits of 8192 positions remain
    unq = predict_peak_bytes(shape, 1, 8192, 0, "unquantized")
    assert unq - shape.weights_bytes > 8192 * 151936 * 2
    assert unq < whole
    with pytest.raises(ValueError):
        predict_peak_bytes(shape, 0, 1, 1, "int8")
    with pytest.raises(ValueError):
        predict_peak_bytes(shape, 1, 1, 1, "int8", prefill_chunk=0)


def test_softmax_in_fp32_costs_more_only_in_int8_prefill() -> None:
    shape = model_shape(QWEN_7B)
    base = predict_peak_bytes(shape, 1, 2048, 0, "int8")
    assert predict_peak_bytes(shape, 1, 2048, 0, "int8", softmax_in_fp32=True) > base
    assert predict_peak_bytes(
        shape, 1, 2048, 0, "unquantized", softmax_in_fp32=True
    ) == predict_peak_bytes(shape, 1, 2048, 0, "unquantized")


def test_fits_sets_the_cuda_context_aside() -> None:
    assert fits(10 * GIB, 10 * GIB + CUDA_CONTEXT_BYTES)
    assert not fits(10 * GIB, 10 * GIB + CUDA_CONTEXT_BYTES - 1)


def test_max_batch_and_max_tokens_are_the_fit_boundary() -> None:
    shape = model_shape(QWEN_7B)
    scenario = Scenario(prompt_tokens=1, prefill_chunk=None, gpu_memory_bytes=80 * GIB)
    for mode in MODES:
        b = max_batch(shape, scenario, mode, 1024)
        assert fits(peak(shape, scenario, mode, b, 1024), 80 * GIB)
        assert not fits(peak(shape, scenario, mode, b + 1, 1024), 80 * GIB)
        t = max_tokens(shape, scenario, mode, 1)
        assert fits(peak(shape, scenario, mode, 1, t), 80 * GIB)
        assert not fits(peak(shape, scenario, mode, 1, t + 1), 80 * GIB)
    assert max_batch(shape, scenario, "int8", 1024) > 1.8 * max_batch(
        shape, scenario, "unquantized", 1024
    )
    small = Scenario(prompt_tokens=1, prefill_chunk=None, gpu_memory_bytes=8 * GIB)
    assert max_batch(shape, small, "int8", 1024) == 0
    assert max_tokens(shape, small, "unquantized", 1) == 0


def test_oom_flags_follow_gpu_memory() -> None:
    shape = model_shape(QWEN_7B)
    result = make_plan(
        shape, Scenario(1, None, 80 * GIB), batches=(1, 64, 100), tokens=(1024, 8192)
    )
    row = result.row(100, 1024)
    assert row.unquantized_oom and not row.int8_oom
    assert (
        result.row(1, 8192)
        == make_plan(shape, Scenario(1, None, 80 * GIB), batches=(1,), tokens=(8192,)).rows[0]
    )
    tiny_gpu = make_plan(
        shape, Scenario(1, None, int(15.25 * GIB)), batches=(1,), tokens=(512, 8192)
    )
    assert [r.int8_oom for r in tiny_gpu.rows] == [False, True]
    assert all(r.unquantized_oom for r in tiny_gpu.rows)


def test_sizes_and_lists() -> None:
    assert parse_size("80GiB") == 80 * GIB
    assert parse_size("80Gi") == 80 * GIB
    assert parse_size("24GB") == 24 * GIB  # as docker reads it, and as a "24 GB" card has
    assert parse_size("24gb") == 24 * GIB
    assert parse_size("80G") == 80 * 10**9  # Kubernetes: G is decimal
    assert parse_size("24000Mi") == 24000 * 2**20
    assert parse_size("81920MiB") == 80 * GIB
    assert parse_size("85899345920B") == 80 * GIB
    assert parse_size("79.5 gib") == int(79.5 * GIB)
    assert parse_size("512M") == 512 * 10**6 and parse_size("1T") == 10**12
    for bad in ("24", "85899345920", "24g", "24m", "lots", "-1GB", "0Gi", "GiB", "24 Gx"):
        with pytest.raises(UsageError):
            parse_size(bad)
    assert parse_int_list("1, 4,16,4", "--batch") == (1, 4, 16)
    for bad in ("", "1,,2", "0", "1.5", "a"):
        with pytest.raises(UsageError):
            parse_int_list(bad, "--batch")


# -- the prediction against the tiny model's real allocations ---------------------------------


def _old_cpu_softmax() -> bool:
    import torch
    from packaging.version import Version

    return Version(torch.__version__.split("+")[0]) < Version("2.1")


OLD_CPU_SOFTMAX = _old_cpu_softmax()


@pytest.mark.slow
def test_prediction_matches_live_tensors_of_the_tiny_model(
    tmp_path: Path, isolated_hf: Path
) -> None:
    """The derivation, checked on the remote code itself: the peak bytes of live tensors
    (what the CUDA allocator would count) of the contract's run on CPU, against plan."""
    pytest.importorskip("transformers")
    from tests.live_tensors import load, measure

    # loaded in this process, so transformers copies its code into the modules cache it read
    # at import (the machine's): a name of its own, not one a user's earlier fix planted into
    d = generate_checkpoint(
        tmp_path / "PlanLiveTensors", layers=2, heads=4, head_dim=128, intermediate=2048
    )
    with_compat(d)  # Qwen's code loads on transformers >= 4.57 only with it
    shape = model_shape(d)
    cases = [(16, 1, 127, None), (8, 256, 16, None), (8, 256, 16, 64)]
    for mode in MODES:
        model = load(str(d), int8=mode == "int8")
        for batch, prompt, new, chunk in cases:
            measured = measure(model, batch, prompt, new, chunk) - shape.weights_bytes
            # no cuBLAS on CPU
            predicted = (
                predict_peak_bytes(shape, batch, prompt, new, mode, chunk)
                - shape.weights_bytes
                - CUBLAS_WORKSPACE_BYTES
            )
            allowed = 0.05 * measured
            if mode == "int8" and OLD_CPU_SOFTMAX:
                # torch < 2.1 has no fp16 softmax on the CPU: the scores [b, h, q, l] go
                # through an fp32 copy there, which plan (the CUDA allocator's view) leaves out
                q = chunk or prompt
                allowed += 4 * batch * shape.heads * q * (prompt + new)
            assert abs(predicted - measured) <= allowed, (mode, batch, prompt, new)
    _fast_path_matches_live_tensors(tmp_path)


def _fast_path_matches_live_tensors(tmp_path: Path) -> None:
    """The same check for the Int8 cache through qwen-kvprep's fast path (a fixed tiny
    checkpoint, the real CPU extension): buffers in whole blocks of FAST_BLOCK tokens,
    appended in place, grown with a copy."""
    from tests.live_tensors import load, measure

    d = generate_checkpoint(tmp_path / "PlanFast", layers=2, heads=4, head_dim=128,
                            intermediate=2048)
    from transformers import dynamic_module_utils as dmu

    from qwen_kvprep.runtime import FAST_MARK

    # the model loads in this process, from the modules cache transformers chose when it was
    # first imported (under xdist, maybe another test's): fix must plant the fast path there
    env = dict(os.environ, HF_MODULES_CACHE=str(dmu.HF_MODULES_CACHE))
    done = kvprep("fix", str(d), "--no-smoke", "--json", env=env, timeout=1800)
    assert done.returncode == 0, done.stdout + done.stderr
    shape = model_shape(d)
    model = load(str(d), int8=True)
    # the run below is the fast path's, or it measures nothing this test is about
    assert any(getattr(type(m), FAST_MARK, False) for m in model.modules()), (
        "the fast path did not load")
    # a decode that grows the buffers (127 + 1 -> 256), a prompt of two blocks, one that
    # grows during decoding (100 -> 128 -> 256), a prompt in chunks that grows the buffers
    for batch, prompt, new, chunk in [(16, 1, 127, None), (8, 256, 16, None), (4, 100, 60, None),
                                      (8, 256, 16, 64)]:
        measured = measure(model, batch, prompt, new, chunk, fast_path=True)
        measured -= shape.weights_bytes
        predicted = (
            predict_peak_bytes(shape, batch, prompt, new, "int8", chunk, fast_path=True)
            - shape.weights_bytes
            - CUBLAS_WORKSPACE_BYTES
        )
        allowed = 0.05 * measured
        if OLD_CPU_SOFTMAX:
            allowed += 4 * batch * shape.heads * prompt * (prompt + new)
        # the CPU kernels' own temporaries can only add to the live peak: plan leaves them
        # out (it predicts the CUDA allocator), so they widen the bound upwards alone
        above = _cpu_gemm_bytes(shape, batch, chunk or prompt, prompt + new)
        assert -allowed <= measured - predicted <= allowed + above, (
            batch, prompt, new, chunk, predicted, measured)
        # the model's own code's prediction is another number
        assert predict_peak_bytes(shape, batch, prompt, new, "int8", chunk) != predicted + \
            shape.weights_bytes + CUBLAS_WORKSPACE_BYTES
    layers = [m for m in model.modules() if hasattr(m, "cache_kernels")]
    assert layers and all(getattr(m, "qwen_kvprep_fast_steps", 0) > 0 for m in layers)


# kernels/cache_autogptq_cuda_256.cpp: from kCpuGemmMinQ queries on, the CPU kernels
# dequantize the cache into fp32 for a GEMM, kCpuGemmChunkBytes of it at a time
CPU_GEMM_MIN_Q = 32
CPU_GEMM_CHUNK_BYTES = 16 << 20


def _cpu_gemm_bytes(shape: Any, batch: int, query: int, length: int) -> int:
    """The most the CPU GEMM path holds at once for one kernel call: the fp32 codes and
    their dequantized copy for a chunk of heads, the fp32 queries or probabilities and
    the fp32 product, the fp32 scales and zeros."""
    if query < CPU_GEMM_MIN_Q:
        return 0
    d = shape.head_dim
    n = min(batch * shape.heads, max(1, CPU_GEMM_CHUNK_BYTES // (length * d * 4)))
    return 4 * n * (2 * length * d + query * (length + d) + 2 * length)


def test_cpu_gemm_constants_match_the_kernels() -> None:
    from qwen_kvprep.resources import kernels_dir

    source = (kernels_dir() / "cache_autogptq_cuda_256.cpp").read_text(encoding="utf-8")
    assert f"kCpuGemmMinQ = {CPU_GEMM_MIN_Q};" in source
    assert f"kCpuGemmChunkBytes = int64_t{{{CPU_GEMM_CHUNK_BYTES >> 20}}} << 20;" in source


def test_fast_path_block_matches_the_planted_module() -> None:
    from qwen_kvprep.planning.peak import FAST_BLOCK
    from qwen_kvprep.resources import templates_dir

    source = (templates_dir() / "qwen_kvprep_kv.py").read_text(encoding="utf-8")
    assert f"\nBLOCK = {FAST_BLOCK}  #" in source


# -- the command --------------------------------------------------------------------------------


def test_cli_json(tmp_path: Path) -> None:
    res = kvprep("plan", str(QWEN_7B), "--gpu-memory", "80GiB", "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["ok"] is True and doc["schema_version"] == 1
    plan = doc["plan"]
    assert plan["weights_bytes"] == 15_442_649_088
    assert plan["kv_bytes_per_token"] == {"unquantized": 524_288, "int8": 270_336}
    assert plan["gpu_memory_bytes"] == 80 * GIB
    assert len(plan["table"]) == 6 * 5
    assert set(plan["table"][0]) == {
        "batch", "tokens", "unquantized_bytes", "int8_bytes", "unquantized_oom", "int8_oom",
    }  # fmt: skip
    assert set(plan["max_batch"]) == set(plan["max_tokens"]) == {"unquantized", "int8"}
    assert plan["max_batch_at_tokens"] == 512 and plan["max_tokens_at_batch"] == 1
    assert plan["prompt_tokens"] == 1 and plan["prefill_chunk"] is None
    assert plan["assumptions"] and all(isinstance(a, str) for a in plan["assumptions"])
    by_key = {(r["batch"], r["tokens"]): r for r in plan["table"]}
    assert by_key[(100, 8192)]["unquantized_oom"] is True
    assert by_key[(1, 512)]["int8_oom"] is False


def test_cli_says_when_the_int8_figures_are_the_fast_path_s(tmp_path: Path) -> None:
    """A folder whose model code imports the fast path is planned with its buffers of whole
    blocks, and says so; the same folder without it is planned as the model's own code."""
    from qwen_kvprep import compat
    from qwen_kvprep.fastkv import patched
    from qwen_kvprep.resources import templates_dir

    d = generate_checkpoint(tmp_path / "tiny", layers=2, heads=4, head_dim=128)
    args = ("plan", str(d), "--gpu-memory", "80GiB", "--batch", "4", "--tokens", "200")
    modeling = d / "modeling_qwen.py"
    original = modeling.read_text(encoding="utf-8")
    # as `fix --no-fast-path` leaves it: its compatibility lines, no fast path
    modeling.write_text(compat.patched(original), encoding="utf-8")
    plain = document(kvprep(*args, "--json"))["plan"]
    modeling.write_text(patched(original), encoding="utf-8")
    (d / "qwen_kvprep_kv.py").write_bytes((templates_dir() / "qwen_kvprep_kv.py").read_bytes())
    fast = document(kvprep(*args, "--json"))["plan"]
    assert (plain["fast_path"], fast["fast_path"]) == (False, True)
    assert any("fast path" in a for a in fast["assumptions"])
    assert fast["table"][0]["int8_bytes"] != plain["table"][0]["int8_bytes"]
    assert fast["table"][0]["unquantized_bytes"] == plain["table"][0]["unquantized_bytes"]
    assert "fast path" in kvprep(*args).stdout


def test_fp32_fast_path_per_token_bytes_are_the_table_s(tmp_path: Path) -> None:
    """fp32: the model's own Int8 code keeps fp32 scales, the fast path fp16 ones. A folder
    planned with the fast path names the fast path's bytes a token, as its table uses."""
    from qwen_kvprep.fastkv import patched
    from qwen_kvprep.resources import templates_dir

    d = generate_checkpoint(tmp_path / "tiny", layers=2, heads=4, head_dim=16, dtype="fp32")
    modeling = d / "modeling_qwen.py"
    modeling.write_text(patched(modeling.read_text(encoding="utf-8")), encoding="utf-8")
    (d / "qwen_kvprep_kv.py").write_bytes((templates_dir() / "qwen_kvprep_kv.py").read_bytes())
    args = ("plan", str(d), "--gpu-memory", "80GiB", "--batch", "4", "--tokens", "200")
    fast = document(kvprep(*args, "--json"))["plan"]
    assert fast["fast_path"] is True
    assert fast["kv_bytes_per_token"]["int8"] == 2 * 2 * 4 * (16 + 2 * 2)  # fp16 scales
    out = kvprep(*args).stdout
    assert "320 B with Int8" in out and "384" not in out, out


def test_a_folder_not_fixed_yet_is_planned_as_fix_will_leave_it(tmp_path: Path) -> None:
    """fix installs the fast path by default: an fp32 folder planned before fix gets the
    fast path's bytes a token (fp16 scales: 320 B, what smoke measures after fix), and the
    text names the --no-fast-path figure (fp32 scales: 384 B)."""
    d = generate_checkpoint(tmp_path / "tiny", layers=2, heads=4, head_dim=16, dtype="fp32")
    args = ("plan", str(d), "--gpu-memory", "80GiB", "--batch", "4", "--tokens", "200")
    plan = document(kvprep(*args, "--json"))["plan"]
    assert plan["fast_path"] is True and plan["fast_path_pending"] is True
    assert plan["kv_bytes_per_token"]["int8"] == 2 * 2 * 4 * (16 + 2 * 2)  # 320
    assert any("not installed yet" in a for a in plan["assumptions"])
    out = kvprep(*args).stdout
    assert "320 B with Int8" in out and "`fix --no-fast-path`: 384 B" in out, out


def test_fp32_fast_path_cards_share_the_header_s_bytes_a_token(
    tmp_path: Path, newest_split: None
) -> None:
    """Split over cards, each card's part of the Int8 cache is counted as the header's figure
    (the fast path's fp16 scales), not the model's own code's fp32 ones: one figure."""
    from qwen_kvprep.fastkv import patched
    from qwen_kvprep.resources import templates_dir

    d = generate_checkpoint(tmp_path / "tiny", layers=2, heads=4, head_dim=16, dtype="fp32")
    modeling = d / "modeling_qwen.py"
    modeling.write_text(patched(modeling.read_text(encoding="utf-8")), encoding="utf-8")
    (d / "qwen_kvprep_kv.py").write_bytes((templates_dir() / "qwen_kvprep_kv.py").read_bytes())
    args = ("plan", str(d), "--gpu-memory", "80GiB", "--gpus", "2", "--batch", "4",
            "--tokens", "200")
    plan = document(invoke(*args, "--json"))["plan"]
    assert plan["fast_path"] is True
    total = plan["kv_bytes_per_token"]
    assert total["int8"] == 2 * 2 * 4 * (16 + 2 * 2)  # fp16 scales: 320
    cards = plan["cards"]
    for mode in ("unquantized", "int8"):
        assert sum(c["kv_bytes_per_token"][mode] for c in cards) == total[mode], cards
    out = invoke(*args).stdout
    assert "320 B with Int8" in out and "160 B" in out, out
    assert "384 B" not in out and "192 B" not in out, out


def test_cli_text_tables() -> None:
    res = kvprep("plan", str(QWEN_7B), "--gpu-memory", "80GiB", "--tokens", "1024,512,8192")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "Peak GPU memory (GiB) by batch, 1,024 tokens cached" in out
    assert "Peak GPU memory (GiB) by tokens cached, batch 1" in out
    assert "| Int8 cache" in out and "OOM" in out  # batch 100 unquantized
    assert "Largest batch at 1,024 tokens:" in out and "Longest context at batch 1:" in out


def test_cli_on_a_tiny_checkpoint(tmp_path: Path) -> None:
    d = generate_checkpoint(tmp_path / "tiny")
    res = kvprep("plan", str(d), "--gpu-memory", "1GiB", "--batch", "1,2", "--tokens", "64,128")
    assert res.returncode == 0, res.stderr
    assert "safetensors headers of 2 files" in res.stdout


def test_cli_needs_gpu_memory_without_a_gpu() -> None:
    res = kvprep("plan", str(QWEN_7B), env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert res.returncode == 2
    assert "--gpu-memory" in res.stderr and "Traceback" not in res.stderr


def test_cli_errors(tmp_path: Path) -> None:
    res = kvprep("plan", str(QWEN_7B), "--gpu-memory", "80")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "needs a unit" in res.stderr and "24Gi" in res.stderr and "--gpu" in res.stderr
    res = kvprep("plan", str(QWEN_7B), "--gpu-memory", "80GiB", "--batch", "0")
    assert res.returncode == 2 and "--batch" in res.stderr
    res = kvprep(
        "plan", str(QWEN_7B), "--gpu-memory", "80GiB", "--tokens", "8", "--prompt-tokens", "9"
    )
    assert res.returncode == 2 and "--prompt-tokens" in res.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    res = kvprep("plan", str(empty), "--gpu-memory", "80GiB")
    assert res.returncode == 1 and "no config.json" in res.stderr
    assert hubcli.download() in res.stderr and "Traceback" not in res.stderr
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "qwen",\n oops}\n')
    res = kvprep("plan", str(bad), "--gpu-memory", "80GiB", "--json")
    assert res.returncode == 1 and "Traceback" not in res.stderr
    doc = json.loads(res.stdout)
    assert doc["ok"] is False and "line 2" in doc["error"]["message"]
    res = kvprep("plan", str(tmp_path / "nope"), "--gpu-memory", "80GiB")
    assert res.returncode == 2 and "no such directory" in res.stderr


def test_kernel_gemm_thresholds_match_the_kernel_sources() -> None:
    """plan counts the GEMM path's workspace from the query lengths the .cu dispatches at."""
    import re

    from qwen_kvprep.planning import peak as plan
    from qwen_kvprep.resources import KERNEL_FILES, kernels_dir

    cu = (kernels_dir() / KERNEL_FILES[1]).read_text()
    found = dict(re.findall(r"constexpr int64_t (kGemmMinQ\w+) = (\d+);", cu))
    assert int(found["kGemmMinQQk"]) == plan.KERNEL_GEMM_MIN_Q_QK
    assert int(found["kGemmMinQPv"]) == plan.KERNEL_GEMM_MIN_Q_PV
    shape = model_shape(Path(__file__).parent / "data" / "qwen-7b-chat-config")
    below = plan.predict_peak_bytes(shape, 1, 2048, 8, "int8", prefill_chunk=127)
    at = plan.predict_peak_bytes(shape, 1, 2048, 8, "int8", prefill_chunk=128)
    assert at - below >= 2 * 32 * 2048 * 128  # one layer's fp16 values, dequantized


# -- which GPU: sizes as Kubernetes and docker write them, cards by name ----------------------


def _planned_bytes(*args: str) -> int:
    res = invoke("plan", str(QWEN_7B), *args, "--json")
    assert res.returncode == 0, res.stderr
    return int(document(res)["plan"]["gpu_memory_bytes"])


def test_gpu_memory_forms_through_the_cli() -> None:
    assert _planned_bytes("--gpu-memory", "24Gi") == 24 * GIB
    assert _planned_bytes("--gpu-memory", "24GiB") == 24 * GIB
    assert _planned_bytes("--gpu-memory", "24GB") == 24 * GIB
    assert _planned_bytes("--gpu-memory", "80G") == 80 * 10**9
    assert _planned_bytes("--gpu-memory", "24000Mi") == 24000 * 2**20
    for bare in ("24", "24g"):
        res = invoke("plan", str(QWEN_7B), "--gpu-memory", bare)
        assert res.returncode == 2, res.stdout
        assert "24Gi" in res.stderr and "10^9" in res.stderr and "Traceback" not in res.stderr


def test_gpu_by_name_and_the_list() -> None:
    from qwen_kvprep.planning.gpu import CARDS

    # the capacity torch reports on the card, not its label
    assert _planned_bytes("--gpu", "a100-80g") == 84987740160
    assert _planned_bytes("--gpu", "RTX 4090") == _planned_bytes("--gpu", "4090")
    assert _planned_bytes("--gpu", "NVIDIA H100 80GB HBM3") == _planned_bytes("--gpu", "h100")
    assert _planned_bytes("--gpu", "H100") < 80 * GIB
    res = invoke("plan", str(QWEN_7B), "--gpu", "4090")
    assert res.returncode == 0 and "NVIDIA GeForce RTX 4090" in res.stdout
    listed = invoke("plan", "--gpu", "list")
    assert listed.returncode == 0
    for card in CARDS:
        assert card.name in listed.stdout and card.product in listed.stdout
    as_json = document(invoke("plan", "--gpu", "list", "--json"))
    assert {g["name"] for g in as_json["gpus"]} == {c.name for c in CARDS}
    for args, said in ((["--gpu", "a100"], "a100-40g"), (["--gpu", "tpu-v5"], "--gpu list"),
                       (["--gpu", "4090", "--gpu-memory", "24Gi"], "one of them")):
        res = invoke("plan", str(QWEN_7B), *args)
        assert res.returncode == 2 and said in res.stderr, (args, res.stderr)
    res = invoke("plan", "--gpu", "4090")
    assert res.returncode == 2 and "model directory" in res.stderr


def test_plan_plot_is_an_svg_without_matplotlib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from xml.etree import ElementTree

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `pip install .` has none
    out = tmp_path / "plan.svg"
    res = invoke("plan", str(QWEN_7B), "--gpu", "a100-80g", "--plot", str(out))
    assert res.returncode == 0, res.stderr
    assert f"Plot: {out}" in res.stdout
    svg = out.read_text()
    ElementTree.fromstring(svg)
    for text in ("unquantized cache", "Int8 cache", "batch size", "tokens cached", "fits below"):
        assert text in svg, text
    res = invoke("plan", str(QWEN_7B), "--gpu", "a100-80g", "--plot", str(tmp_path / "p.png"))
    assert res.returncode == 2 and "p.svg" in res.stderr and "[plot]" in res.stderr
    assert not (tmp_path / "p.png").exists()
    res = invoke("plan", str(QWEN_7B), "--gpu", "a100-80g", "--plot", str(tmp_path / "p.pdf"))
    assert res.returncode == 2 and ".svg or .png" in res.stderr
    os.mkfifo(tmp_path / "fifo.svg")
    res = invoke("plan", str(QWEN_7B), "--gpu", "a100-80g", "--plot", str(tmp_path / "fifo.svg"))
    assert res.returncode == 2 and "a FIFO (named pipe), not a regular file" in res.stderr
    assert stat.S_ISFIFO(os.lstat(tmp_path / "fifo.svg").st_mode)


def test_plan_plot_png_with_matplotlib(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "plan.png"
    res = invoke("plan", str(QWEN_7B), "--gpu-memory", "80Gi", "--plot", str(out), "--json")
    assert res.returncode == 0, res.stderr
    assert document(res)["plan"]["plot"] == str(out)
    assert out.read_bytes().startswith(b"\x89PNG")


def test_without_gpu_options_plan_takes_the_gpu_present(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")

    class Props:
        name, total_memory = "NVIDIA L4", 23612293120

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _i: Props())
    res = invoke("plan", str(QWEN_7B), "--json")
    assert res.returncode == 0, res.stderr
    plan = document(res)["plan"]
    assert plan["gpu_memory_bytes"] == 23612293120
    assert plan["gpu_memory_source"] == "cuda:0 (NVIDIA L4)"


# -- several cards: --gpus N, split as transformers' device_map="auto" splits the model -------

A100_80G = 84987740160  # --gpu a100-80g
RTX_4090 = 25250627584  # --gpu 4090


@pytest.fixture()
def newest_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """plan as it splits with transformers 5.18 or later installed, whatever this
    environment has (test_the_split_follows_the_margin_of_the_installed_release checks
    that plan asks the installed release)."""
    import qwen_kvprep.planning as planning

    monkeypatch.setattr(planning, "installed_release", lambda package: (5, 24, 0))


def _layers_per_card(shape: Any, memory: int, gpus: int) -> list[int]:
    from qwen_kvprep.planning.split import split_model

    return [len(card.layers) for card in split_model(shape, memory, gpus).cards]


def test_split_is_device_map_auto_s() -> None:
    """The blocks per card are what transformers 5.24's get_balanced_memory and
    infer_auto_device_map give for a meta-device model of each shape (checked against them
    by test_split_agrees_with_transformers where accelerate is installed); whole blocks in
    order, wte on the first card, ln_f and lm_head after the last block."""
    from qwen_kvprep.planning.split import split_model

    big, small = model_shape(QWEN_72B), model_shape(QWEN_1_8B)
    assert _layers_per_card(big, A100_80G, 2) == [40, 40]
    assert _layers_per_card(big, A100_80G, 3) == [26, 29, 25]
    assert _layers_per_card(big, A100_80G, 4) == [19, 22, 22, 17]
    assert _layers_per_card(small, A100_80G, 3) == [7, 17, 0]
    for gpus in (2, 3, 4, 8):
        split = split_model(big, A100_80G, gpus)
        assert split.holds_weights and not split.offloaded
        assert sum(c.weights_bytes for c in split.cards) == big.weights_bytes
        assert all(c.weights_bytes <= c.budget_bytes <= A100_80G for c in split.cards)
        order = [m.name for c in split.cards for m in c.modules]
        assert order == ["wte", *(f"h.{i}" for i in range(80)), "ln_f", "lm_head"]
        assert split.cards[0].modules[0].name == "wte"
    # 24 GiB cards: two hold 25 of 80 blocks, the rest would be offloaded to the CPU
    split = split_model(big, RTX_4090, 2)
    assert not split.holds_weights and len(split.cards[0].layers) + len(
        split.cards[1].layers) == 25
    assert [m.name for m in split.offloaded][-2:] == ["ln_f", "lm_head"]


def test_fewest_gpus_that_hold_the_weights() -> None:
    from qwen_kvprep.planning.split import fewest_gpus, split_model

    big = model_shape(QWEN_72B)
    assert fewest_gpus(big, A100_80G) == 2
    assert fewest_gpus(big, RTX_4090) == 7
    assert not split_model(big, RTX_4090, 6).holds_weights
    assert fewest_gpus(model_shape(QWEN_7B), RTX_4090) == 1
    assert fewest_gpus(big, 1 << 30) == 0  # not even 64 cards of 1 GiB


def test_split_agrees_with_transformers() -> None:
    """Where accelerate is installed next to transformers 5, their own split of a
    meta-device model shaped like Qwen (v1) is plan's, module by module."""
    import torch
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        needs.skip("transformers-5", "transformers 4.x balances with accelerate's margin")
    try:
        import accelerate  # noqa: F401
    except ImportError:
        needs.skip("accelerate", "transformers' device_map='auto' is accelerate's")
    from torch import nn
    from transformers.integrations.accelerate import get_balanced_memory, infer_auto_device_map

    from qwen_kvprep.planning import installed_release
    from qwen_kvprep.planning.split import leaf_margin, split_model, usable_bytes

    release = installed_release("transformers")

    class Norm(nn.Module):
        def __init__(self, h: int) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.empty(h))

    class QWenBlock(nn.Module):
        def __init__(self, h: int, p: int, f: int) -> None:
            super().__init__()
            self.ln_1, self.ln_2 = Norm(h), Norm(h)
            self.c_attn, self.c_proj = nn.Linear(h, 3 * p), nn.Linear(p, h, bias=False)
            self.w1, self.w2 = nn.Linear(h, f, bias=False), nn.Linear(h, f, bias=False)
            self.mlp_proj = nn.Linear(f, h, bias=False)

    class Body(nn.Module):
        def __init__(self, shape: Any) -> None:
            super().__init__()
            h = shape.hidden
            self.wte = nn.Embedding(shape.vocab, h)
            p, f = shape.heads * shape.head_dim, shape.intermediate // 2
            self.h = nn.ModuleList(QWenBlock(h, p, f) for _ in range(shape.layers))
            self.ln_f = Norm(h)

    class Model(nn.Module):
        def __init__(self, shape: Any) -> None:
            super().__init__()
            self.all_tied_weights_keys: dict[str, str] = {}  # nothing tied in Qwen (v1)
            self.transformer = Body(shape)
            self.lm_head = nn.Linear(shape.hidden, shape.vocab, bias=False)

    shape = model_shape(QWEN_72B)
    with torch.device("meta"):
        model = Model(shape).to(torch.bfloat16)
    for memory, gpus in ((A100_80G, 2), (A100_80G, 3), (RTX_4090, 4), (RTX_4090, 8)):
        free = {i: usable_bytes(memory) for i in range(gpus)}
        budgets = get_balanced_memory(model, max_memory={**free, "cpu": 1 << 50},
                                      no_split_module_classes=["QWenBlock"])
        theirs = infer_auto_device_map(model, max_memory=budgets,
                                       no_split_module_classes=["QWenBlock"], clean_result=False)
        where = {name.removeprefix("transformer."): device for name, device in theirs.items()}
        # the margin of the running release (5.18 changed it: leaf_margin)
        split = split_model(shape, memory, gpus, with_leaf=leaf_margin(release))
        ours = {m.name: c.index for c in split.cards for m in c.modules}
        ours.update({m.name: "cpu" for m in split.offloaded})
        assert {n: where.get(n) for n in ours} == ours, (memory, gpus, release)


def test_the_split_follows_the_margin_of_the_installed_release(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """transformers 5.18 made the balanced split's margin the largest leaf module (wte or
    lm_head) where 5.0 to 5.17 (and accelerate's function on 4.x) took the mean of the
    leaves, below one block: Qwen-72B on two 80 GB cards is 40 + 40 blocks on the newer,
    39 + 41 on the older, and plan follows the release installed (none: the newest)."""
    from qwen_kvprep.planning.split import leaf_margin, split_model

    assert [leaf_margin(r) for r in ((5, 18, 0), (5, 24), (6, 0), None)] == [True] * 4
    assert [leaf_margin(r) for r in ((5, 17, 0), (5, 0), (4, 53, 3), (4, 32))] == [False] * 4
    big = model_shape(QWEN_72B)
    cards = [len(c.layers) for c in split_model(big, A100_80G, 2, with_leaf=False).cards]
    assert cards == [39, 41]
    assert _layers_per_card(big, A100_80G, 2) == [40, 40]
    import transformers

    import qwen_kvprep.planning as planning

    installed = planning.installed_release("transformers")
    running = tuple(int(p) for p in transformers.__version__.split(".")[:2])
    assert installed is not None and installed[:2] == running
    for release, blocks in (((5, 17, 0), [39, 41]), ((5, 24, 0), [40, 40]), (None, [40, 40])):
        monkeypatch.setattr(planning, "installed_release", lambda package, r=release: r)
        plan = planning.plan_checkpoint(QWEN_72B, (1,), (512,), (A100_80G, "test"), gpus=2)
        assert [len(c.layers) for c in plan.result.split.cards] == blocks, release


def test_card_peaks_follow_the_split() -> None:
    """Each card's peak is its weights, its blocks' part of the past and of the new cache,
    and transients; one card holding the whole model is the single-GPU prediction."""
    from qwen_kvprep.planning.peak import whole
    from qwen_kvprep.planning.split import split_model

    shape = model_shape(QWEN_72B)
    for mode in MODES:
        assert predict_peak_bytes(shape, 4, 1, 511, mode, share=whole(shape)) == (
            predict_peak_bytes(shape, 4, 1, 511, mode))
    split = split_model(shape, A100_80G, 3)
    two = Scenario(prompt_tokens=1, prefill_chunk=None, gpu_memory_bytes=A100_80G, gpus=3)
    for mode in MODES:
        short = card_peaks(shape, two, mode, 4, 512)
        long = card_peaks(shape, two, mode, 4, 4608)
        for card, a, b in zip(split.cards, short, long):
            per_token = kv_bytes_per_token(shape, mode) * len(card.layers) // shape.layers
            cache = 4 * 4096 * 2 * per_token  # 4096 more tokens, old and new cache alive
            # and longer rotary tables; for Int8 the last block's longer transposed key
            # codes and scores (4·64·128·4096 bytes more codes)
            slack = (32 if mode == "unquantized" else 256) * MIB
            assert cache <= b - a < cache + slack, (mode, card.index)
            assert card.weights_bytes + 4 * 511 * 2 * per_token < a < (
                card.weights_bytes + 4 * 512 * 2 * per_token + 512 * MIB)


def test_weights_beyond_one_card_are_said_with_the_cards_that_hold_them(newest_split: None) -> None:
    res = invoke("plan", str(QWEN_72B), "--gpu", "a100-80g")
    assert res.returncode == 0, res.stderr
    assert "the weights alone (134.65 GiB) exceed the card: 78.65 GiB usable" in res.stdout
    assert "fix: --gpus 2: the fewest cards" in res.stdout and "plan.weights" in res.stdout
    doc = document(invoke("plan", str(QWEN_72B), "--gpu", "a100-80g", "--json"))
    (finding,) = doc["findings"]
    assert finding["id"] == "plan.weights" and finding["severity"] == "warn"
    assert finding["details"]["fewest_gpus"] == 2
    assert finding["details"]["weights_bytes"] == doc["plan"]["weights_bytes"]
    assert doc["plan"]["weights_fit"] is False and doc["plan"]["gpus"] == 1
    # two 24 GiB cards offload; seven hold the weights
    doc = document(invoke("plan", str(QWEN_72B), "--gpu", "4090", "--gpus", "2", "--json"))
    (finding,) = doc["findings"]
    assert "do not fit 2 cards" in finding["message"] and "--gpus 7" in finding["fix"]
    assert doc["plan"]["offloaded"][-1] == "lm_head"
    assert all(r["int8_oom"] and r["unquantized_oom"] for r in doc["plan"]["table"])
    assert doc["plan"]["max_batch"] == {"unquantized": 0, "int8": 0}
    # a model that fits says nothing of the kind
    doc = document(invoke("plan", str(QWEN_7B), "--gpu", "a100-80g", "--json"))
    assert doc["findings"] == [] and doc["plan"]["weights_fit"] is True


def test_gpus_2_plans_72b_on_80g_cards(newest_split: None) -> None:
    res = invoke("plan", str(QWEN_72B), "--gpu", "a100-80g", "--gpus", "2", "--json")
    assert res.returncode == 0, res.stderr
    doc = document(res)
    plan = doc["plan"]
    assert doc["findings"] == [] and plan["gpus"] == 2 and plan["weights_fit"] is True
    cards = plan["cards"]
    assert [c["layers"] for c in cards] == [40, 40]
    assert [(c["first_layer"], c["last_layer"]) for c in cards] == [(0, 39), (40, 79)]
    assert [c["modules"] for c in cards] == [["wte"], ["ln_f", "lm_head"]]
    assert sum(c["weights_bytes"] for c in cards) == plan["weights_bytes"]
    assert all(c["weights_bytes"] <= c["budget_bytes"] <= A100_80G for c in cards)
    for mode in MODES:
        assert sum(c["kv_bytes_per_token"][mode] for c in cards) == (
            plan["kv_bytes_per_token"][mode])
        assert plan["max_batch"][mode] > 0 and plan["max_tokens"][mode] > 0
        assert plan["max_batch_card"][mode] in (0, 1)
    assert plan["max_batch"]["int8"] > plan["max_batch"]["unquantized"]
    for row in plan["table"]:
        for mode in MODES:
            per_card = row[f"{mode}_card_bytes"]
            assert len(per_card) == 2 and row[f"{mode}_bytes"] == max(per_card)
            fits_all = all(b + 512 * MIB <= A100_80G for b in per_card)
            assert row[f"{mode}_oom"] is not fits_all
    first = plan["table"][0]  # batch 1, 512 tokens: the weights, 511 tokens handed in, 512 out
    for card, peak_bytes in zip(cards, first["int8_card_bytes"]):
        core = card["weights_bytes"] + (511 + 512) * card["kv_bytes_per_token"]["int8"]
        assert core < peak_bytes < core + 128 * MIB
    # the largest batch is the fit boundary of the card that runs out first
    shape = model_shape(QWEN_72B)
    scenario = Scenario(prompt_tokens=1, prefill_chunk=None, gpu_memory_bytes=A100_80G, gpus=2)
    for mode in MODES:
        most = plan["max_batch"][mode]
        assert max_batch(shape, scenario, mode, 512) == most
        over = card_peaks(shape, scenario, mode, most + 1, 512)
        short = [i for i, b in enumerate(over) if b + 512 * MIB > A100_80G]
        assert short and short[0] == plan["max_batch_card"][mode]
    text = invoke("plan", str(QWEN_72B), "--gpu", "a100-80g", "--gpus", "2").stdout
    assert "GPUs       2 × 79.15 GiB" in text
    assert "| wte, layers 0-39 (40)" in text and "layers 40-79 (40), ln_f, lm_head" in text
    assert "Peak GPU memory of the fullest card (GiB) by batch" in text
    assert "runs out first" in text and "OOM" in text and "plan.weights" not in text


def test_one_gpu_is_the_plan_as_before() -> None:
    args = ("plan", str(QWEN_7B), "--gpu", "a100-80g", "--batch", "1,16", "--tokens", "512")
    plain, one = invoke(*args), invoke(*args, "--gpus", "1")
    assert plain.returncode == one.returncode == 0
    assert plain.stdout == one.stdout and "card" not in plain.stdout
    row = document(invoke(*args, "--json"))["plan"]["table"][0]
    assert "int8_card_bytes" not in row


def test_gpus_in_the_plot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, newest_split: None
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = tmp_path / "plan.svg"
    res = invoke("plan", str(QWEN_72B), "--gpu", "a100-80g", "--gpus", "2", "--plot", str(out))
    assert res.returncode == 0, res.stderr
    svg = out.read_text()
    assert "on each of 2 cards" in svg
    assert "Int8 cache, card 0 (wte, layers 0-39 (40))" in svg
    assert "unquantized cache, card 1 (layers 40-79 (40), ln_f, lm_head)" in svg


@pytest.mark.parametrize(
    ("value", "said"),
    [("0", "0 is not in the range 1<=x<=64"), ("-2", "-2 is not in the range"),
     ("1.5", "'1.5' is not a valid integer"), ("two", "'two' is not a valid integer"),
     ("65", "65 is not in the range 1<=x<=64")],
)
def test_bad_gpus_are_refused(value: str, said: str) -> None:
    res = invoke("plan", str(QWEN_72B), "--gpu", "a100-80g", "--gpus", value)
    assert res.returncode == 2 and "--gpus" in res.stderr and said in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def test_the_cli_s_limit_is_split_s() -> None:
    from qwen_kvprep.commands import plan as command
    from qwen_kvprep.planning import split

    assert command.MAX_GPUS == split.MAX_GPUS


def test_a_config_that_is_not_utf8_is_named_not_shown_as_mojibake(tmp_path: Path) -> None:
    d = generate_checkpoint(tmp_path / "tiny", layers=2, heads=4, head_dim=128)
    config = d / "config.json"
    config.write_bytes(config.read_bytes().replace(b'"qwen"', b'"qw\xff\xfeen"', 1))
    done = invoke("plan", str(d), "--gpu-memory", "80GiB")
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"{config} is not UTF-8 text" in done.stderr
    assert "\ufffd" not in done.stdout + done.stderr and "model_type" not in done.stderr
