"""convert's core: the exact, streamed mapping of the weights, the Qwen2 config, GPTQ's
splits and the bit-for-bit comparison, on tiny real-code-shaped checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qwen_kvprep.convert import weights
from qwen_kvprep.convert.compare import compare
from qwen_kvprep.convert.gptq import GptqLayout, gptq_pieces, layout
from qwen_kvprep.convert.mapping import plan
from qwen_kvprep.convert.pieces import TensorInfo
from qwen_kvprep.convert.run import ConvertOptions, convert, summary
from qwen_kvprep.convert.source import read_source
from qwen_kvprep.errors import CheckpointError, RefusedError, StateError, UsageError
from qwen_kvprep.probe.checkpoint import probe_checkpoint
from qwen_kvprep.provenance import read as read_provenance
from qwen_kvprep.tiny import generate_checkpoint
from tests.convert_kit import bits_equal, dequantize, expected_dense, load_out, load_source

NO_VERIFY = ConvertOptions(verify=False)


def _convert(tmp_path: Path, **kw: object) -> tuple[Path, Path]:
    ckpt = generate_checkpoint(tmp_path / "ckpt", **kw)  # type: ignore[arg-type]
    out = tmp_path / "out"
    convert(ckpt, out, NO_VERIFY)
    return ckpt, out


@pytest.mark.parametrize(
    "kw",
    [
        {"shards": 3},
        {"shards": 1, "dtype": "fp32"},
        {"legacy_bin": True},
        {"dtype": "fp16", "layers": 3},
        {"dtype": "auto"},
    ],
    ids=["bf16-3-shards", "fp32-single", "legacy-bin", "fp16-3-layers", "auto"],
)
def test_every_tensor_maps_bit_for_bit(tmp_path: Path, kw: dict[str, object]) -> None:
    ckpt, out = _convert(tmp_path, **kw)
    src = load_source(ckpt)
    got = load_out(out)
    exp = expected_dense(src, int(kw.get("layers", 2)))  # type: ignore[call-overload]
    assert set(got) == set(exp)
    for name, tensor in exp.items():
        assert bits_equal(got[name], tensor), name
    # the source's sharding is kept: one output shard per source weight file
    n_src = len([p for p in ckpt.iterdir() if p.suffix in (".safetensors", ".bin")])
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) == n_src
    if n_src > 1:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(exp)
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size()
                                                      for t in exp.values())
    assert not any(p.suffix == ".py" for p in out.iterdir())


def test_max_shard_size_splits_the_output(tmp_path: Path) -> None:
    ckpt = generate_checkpoint(tmp_path / "ckpt", shards=1)
    out = tmp_path / "out"
    convert(ckpt, out, ConvertOptions(verify=False, max_shard_size=600_000))
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 2
    for path in shards:  # a tensor alone may exceed it: the embedding is 393 KB here
        assert path.stat().st_size < 600_000 + 400_000
    got = load_out(out)
    exp = expected_dense(load_source(ckpt), 2)
    assert all(bits_equal(got[n], t) for n, t in exp.items())


def test_config_is_native_qwen2(tmp_path: Path) -> None:
    ckpt, out = _convert(tmp_path, shards=2, dtype="bf16")
    src = json.loads((ckpt / "config.json").read_text())
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "qwen2"
    assert cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert "auto_map" not in cfg
    assert cfg["intermediate_size"] == src["intermediate_size"] // 2
    assert cfg["rope_theta"] == src["rotary_emb_base"]
    assert cfg["rms_norm_eps"] == src["layer_norm_epsilon"]
    assert cfg["num_key_value_heads"] == cfg["num_attention_heads"] == src["num_attention_heads"]
    assert cfg["vocab_size"] == src["vocab_size"]
    assert cfg["tie_word_embeddings"] is False
    assert cfg["torch_dtype"] == cfg["dtype"] == "bfloat16"
    assert cfg["max_position_embeddings"] == src["seq_length"]
    assert cfg["rope_scaling"] is None and cfg["use_sliding_window"] is False
    gen = json.loads((ckpt / "generation_config.json").read_text())
    assert cfg["eos_token_id"] == gen["eos_token_id"]


def test_auto_dtype_is_the_stored_one(tmp_path: Path) -> None:
    _, out = _convert(tmp_path, dtype="auto")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


@pytest.mark.parametrize("kind", ["yarn", "dynamic"])
def test_context_factor_sets_rope_scaling_and_says_it_is_not_exact(
    tmp_path: Path, kind: str
) -> None:
    ckpt = generate_checkpoint(tmp_path / "ckpt", config_overrides={"seq_length": 2048})
    result = convert(
        ckpt, tmp_path / "out",
        ConvertOptions(verify=False, context_factor=4.0, rope_scaling=kind),
    )
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    scaling = {"type": kind, "rope_type": kind, "factor": 4.0}
    if kind == "yarn":  # the trained length in rope_scaling, the extended one declared
        assert cfg["max_position_embeddings"] == 8192
        assert cfg["rope_scaling"] == {**scaling, "original_max_position_embeddings": 2048}
    else:  # dynamic NTK scales past max_position_embeddings itself
        assert cfg["max_position_embeddings"] == 2048
        assert cfg["rope_scaling"] == scaling
    assert result.ctx.serving_length == 8192
    said = " ".join(f.message for f in result.findings)
    rec = read_provenance(tmp_path / "out")
    doc = result.to_json()
    if kind == "yarn":  # yarn rescales every position: exact at no length, and said so
        assert "exact at no length" in said and "exact up to" not in said
        assert rec.exact_up_to is None and doc["exact_up_to"] is None
        assert "exact up to" not in rec.exact_words and "exact up to" not in result.exact_words
    else:  # transformers' dynamic NTK starts past max_position_embeddings
        assert "exact up to 2,048 tokens in transformers" in said
        assert "exact at no length in vLLM" in said
        assert rec.exact_up_to == 2048 and doc["exact_up_to"] == 2048
    raw = json.loads((tmp_path / "out" / "provenance.json").read_text())
    assert raw["exact"] == result.exact_words == rec.exact_words
    text = list(summary(result))
    read = text[: text.index("serve it with:")]  # the command lines are copied whole
    assert all(len(line) <= 100 for line in read), max(read, key=len)
    assert "exact" in " ".join(read)


def test_context_factor_needs_its_rope_scaling(tmp_path: Path) -> None:
    ckpt = generate_checkpoint(tmp_path / "ckpt")
    with pytest.raises(UsageError, match="go together"):
        convert(ckpt, tmp_path / "out", ConvertOptions(verify=False, context_factor=2.0))
    assert not (tmp_path / "out").exists()


def _infos(tensors: dict[str, torch.Tensor]) -> dict[str, TensorInfo]:
    return {n: TensorInfo(str(t.dtype)[6:], tuple(t.shape)) for n, t in tensors.items()}


def _tiny_config(ckpt: Path) -> dict[str, object]:
    data: dict[str, object] = json.loads((ckpt / "config.json").read_text())
    return data


def test_plan_names_the_missing_unknown_and_misshapen_tensor(tmp_path: Path) -> None:
    ckpt = generate_checkpoint(tmp_path / "ckpt", shards=1)
    config, found = _tiny_config(ckpt), _infos(load_source(ckpt))
    plan(config, found)  # sound as written
    missing = dict(found)
    del missing["transformer.h.1.mlp.w2.weight"]
    with pytest.raises(CheckpointError, match=r"transformer\.h\.1\.mlp\.w2\.weight is missing"):
        plan(config, missing)
    inv_freq = "transformer.h.0.attn.rotary_emb.inv_freq"
    extra = dict(found, **{inv_freq: TensorInfo("float32", (64,))})
    with pytest.raises(CheckpointError, match=r"rotary_emb\.inv_freq is not a tensor of this"):
        plan(config, extra)
    wrong = dict(found, **{"lm_head.weight": TensorInfo("bfloat16", (10, 256))})
    with pytest.raises(CheckpointError, match=r"lm_head\.weight has shape \[10, 256\]"):
        plan(config, wrong)
    with pytest.raises(CheckpointError, match=r"\(layers 3, .*transformer\.h\.2\.ln_1\.weight"):
        plan({**config, "num_hidden_layers": 3}, found)


def test_a_mismatch_writes_nothing(tmp_path: Path) -> None:
    ckpt = generate_checkpoint(tmp_path / "ckpt", config_overrides={"num_hidden_layers": 3})
    with pytest.raises(CheckpointError, match=r"transformer\.h\.2"):
        convert(ckpt, tmp_path / "out", NO_VERIFY)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_compare_finds_a_changed_tensor(tmp_path: Path) -> None:
    ckpt, out = _convert(tmp_path, shards=1, dtype="fp32")
    sp = read_source(probe_checkpoint(ckpt))
    assert compare(sp, out).ok
    tensors = load_out(out)
    tensors["model.layers.1.self_attn.k_proj.bias"][3] += 1
    from safetensors.torch import save_file

    save_file(tensors, str(out / "model.safetensors"))
    result = compare(sp, out)
    assert result.problems == [
        "model.layers.1.self_attn.k_proj.bias differs from "
        "transformer.h.1.attn.c_attn.bias[256:512] along dim 0"
    ]


def test_provenance_records_the_sources_and_outputs(tmp_path: Path) -> None:
    ckpt, out = _convert(tmp_path, shards=2)
    rec = read_provenance(out)
    assert rec.source_path == str(ckpt)
    assert rec.exact_up_to == 8192
    assert weights.sha256_stream(ckpt / "model-00001-of-00002.safetensors") == (
        rec.source_files["model-00001-of-00002.safetensors"].sha256
    )
    assert set(rec.outputs) >= {"config.json", "model.safetensors.index.json"}
    for name, fr in rec.outputs.items():
        assert weights.sha256_stream(out / name) == fr.sha256, name
    raw = json.loads((out / "provenance.json").read_text())
    assert raw["exact"] == "exact up to 8,192 tokens"
    raw["outputs"]["../x"] = raw["outputs"]["config.json"]
    (out / "provenance.json").write_text(json.dumps(raw))
    with pytest.raises(StateError, match="not a plain file name"):
        read_provenance(out)


# -- GPTQ ----------------------------------------------------------------------------------


def test_gptq_splits_dequantize_to_the_rows_of_c_attn(tmp_path: Path) -> None:
    ckpt, out = _convert(tmp_path, gptq=True, shards=2)
    src, got = load_source(ckpt), load_out(out)
    for i in range(2):
        s, d = f"transformer.h.{i}.", f"model.layers.{i}."
        whole = dequantize(src, s + "attn.c_attn")
        h = whole.shape[0] // 3
        for k, name in enumerate(("q_proj", "k_proj", "v_proj")):
            part = dequantize(got, f"{d}self_attn.{name}")
            assert torch.equal(part, whole[k * h : (k + 1) * h]), name
            assert bits_equal(got[f"{d}self_attn.{name}.g_idx"], src[s + "attn.c_attn.g_idx"])
            assert bits_equal(
                got[f"{d}self_attn.{name}.bias"], src[s + "attn.c_attn.bias"][k * h : (k + 1) * h]
            )
        for old, new in (("mlp.w2", "mlp.gate_proj"), ("mlp.w1", "mlp.up_proj"),
                         ("mlp.c_proj", "mlp.down_proj"), ("attn.c_proj", "self_attn.o_proj")):
            for part in ("qweight", "qzeros", "scales", "g_idx"):
                assert bits_equal(got[f"{d}{new}.{part}"], src[f"{s}{old}.{part}"])
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "gptq" and qc["bits"] == 4 and qc["group_size"] == 128
    assert qc["checkpoint_format"] == "gptq"
    assert cfg["torch_dtype"] == "float16"
    assert json.loads((out / "quantize_config.json").read_text())["bits"] == 4


def test_gptq_refuses_a_boundary_inside_a_packed_word() -> None:
    with pytest.raises(CheckpointError, match="not a multiple of 8"):
        gptq_pieces("transformer.h.0.attn.c_attn", ["q", "k", "v"], 12, GptqLayout(4, 128))
    assert len(gptq_pieces("p", ["q", "k", "v"], 16, GptqLayout(4, 128))) == 12
    with pytest.raises(CheckpointError, match="3 bits"):
        layout(3, 128)


def test_sharded_bin_input(tmp_path: Path) -> None:
    """pytorch_model-0000N-of-0000M.bin with its index, as older checkpoints ship them."""
    ckpt = generate_checkpoint(tmp_path / "ckpt", legacy_bin=True, dtype="fp16")
    whole = torch.load(str(ckpt / "pytorch_model.bin"), weights_only=True)
    names = list(whole)
    halves = {"pytorch_model-00001-of-00002.bin": names[: len(names) // 2],
              "pytorch_model-00002-of-00002.bin": names[len(names) // 2 :]}
    for fname, part in halves.items():
        torch.save({n: whole[n] for n in part}, str(ckpt / fname))
    (ckpt / "pytorch_model.bin").unlink()
    index = {"metadata": {"total_size": 0},
             "weight_map": {n: f for f, part in halves.items() for n in part}}
    (ckpt / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    out = tmp_path / "out"
    convert(ckpt, out, NO_VERIFY)
    got, exp = load_out(out), expected_dense(whole, 2)
    assert set(got) == set(exp) and all(bits_equal(got[n], t) for n, t in exp.items())
    assert len(list(out.glob("model-*-of-00002.safetensors"))) == 2
    rec = read_provenance(out)
    assert set(halves) | {"pytorch_model.bin.index.json", "config.json"} <= set(rec.source_files)


def test_hub_repo_id_in_the_local_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.cli import document, invoke
    from tests.hf_settings import set_hf_constant
    from tests.hubcache_kit import cache_repo
    from tests.treesnap import snapshot

    ckpt = generate_checkpoint(tmp_path / "ckpt", shards=2)
    hub = tmp_path / "hub"
    snap = cache_repo(hub, "Qwen/Qwen-Tiny-Chat", ckpt)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    # huggingface_hub read the variable at its import, maybe in an earlier test of this worker
    set_hf_constant(monkeypatch, "HF_HUB_CACHE", str(hub))
    before = snapshot(hub, mtimes=True)
    res = invoke("convert", "Qwen/Qwen-Tiny-Chat", str(tmp_path / "out"), "--no-verify",
                 "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    assert document(res)["compare"]["ok"]
    assert snapshot(hub, mtimes=True) == before  # the blobs and links are only read
    rec = read_provenance(tmp_path / "out")
    assert rec.source_path == str(snap) and rec.spelt == "Qwen/Qwen-Tiny-Chat"
    got, exp = load_out(tmp_path / "out"), expected_dense(load_source(ckpt), 2)
    assert all(bits_equal(got[n], t) for n, t in exp.items())


def test_a_bin_in_torch_legacy_format_is_read_whole(tmp_path: Path) -> None:
    """torch's format before 1.6 cannot be memory-mapped: it is read without the mmap."""
    ckpt = generate_checkpoint(tmp_path / "ckpt", legacy_bin=True)
    whole = torch.load(str(ckpt / "pytorch_model.bin"), weights_only=True)
    torch.save(whole, str(ckpt / "pytorch_model.bin"), _use_new_zipfile_serialization=False)
    convert(ckpt, tmp_path / "out", NO_VERIFY)
    got, exp = load_out(tmp_path / "out"), expected_dense(whole, 2)
    assert all(bits_equal(got[n], t) for n, t in exp.items())


# -- what convert read, and inputs that do not fit each other -----------------------------


def test_a_side_file_changed_during_the_convert_is_refused(tmp_path: Path) -> None:
    """provenance.json names the bytes convert read: a generation_config.json rewritten
    while the weights are written is caught at the end, and nothing is published."""
    ckpt = generate_checkpoint(tmp_path / "ckpt", shards=1)
    gen = ckpt / "generation_config.json"

    def log(message: str) -> None:
        if message.startswith("checking every tensor"):  # after OUT's copy was written
            data = json.loads(gen.read_text())
            data["top_p"] = 0.5
            gen.write_text(json.dumps(data))

    with pytest.raises(RefusedError) as info:
        convert(ckpt, tmp_path / "out", NO_VERIFY, log=log)
    assert "generation_config.json" in info.value.message and "changed" in info.value.message
    assert not (tmp_path / "out").exists()
    # unchanged, the record holds the hashes of the files read
    out = convert(ckpt, tmp_path / "again", NO_VERIFY).out
    rec = read_provenance(out)
    assert rec.source_files["generation_config.json"].sha256 == weights.sha256_stream(gen)
    assert json.loads((out / "generation_config.json").read_text())["top_p"] == 0.5


def test_a_tiktoken_with_more_ids_than_the_embedding_has_rows_is_refused(
    tmp_path: Path,
) -> None:
    """512 + 60 ranks and the 208 special tokens are 780 ids; the embedding has 768 rows:
    refused before anything is written, with --no-verify too."""
    ckpt = generate_checkpoint(tmp_path / "ckpt", shards=1)
    bigger = generate_checkpoint(tmp_path / "bigger", shards=1, vocab_merges=316)
    (ckpt / "qwen.tiktoken").write_bytes((bigger / "qwen.tiktoken").read_bytes())
    (ckpt / "generation_config.json").unlink()  # no eos id of its own to disagree with
    out = tmp_path / "out"
    with pytest.raises(CheckpointError) as info:
        convert(ckpt, out, NO_VERIFY)
    message = info.value.message
    assert "572 ranks" in message and "780 ids" in message and "768 rows" in message
    assert info.value.fix and "--force-download" in info.value.fix
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_without_a_generation_config_both_configs_stop_on_endoftext(tmp_path: Path) -> None:
    ckpt = generate_checkpoint(tmp_path / "ckpt", shards=1)
    (ckpt / "generation_config.json").unlink()
    out = convert(ckpt, tmp_path / "out", NO_VERIFY).out
    config = json.loads((out / "config.json").read_text())
    gen = json.loads((out / "generation_config.json").read_text())
    assert config["eos_token_id"] == gen["eos_token_id"] == 512  # <|endoftext|>
    assert config["bos_token_id"] == 512
