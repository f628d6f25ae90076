"""The engine smoke's KV table in vLLM, on a model whose K and V run past fp8 e4m3's range
(tests/kv_fixture.py) and whose folder carries calibrated KV scales: one conversion, one
engine smoke (one vLLM child, a start per dtype and scales), several judgements of it.

Needs vLLM (CI's engine stage) on a CPU with AVX-512 or AMX: vLLM's CPU build quantizes its
KV cache nowhere else.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from qwen_kvprep.tiny import generate_checkpoint
from tests import needs
from tests.cli import document, kvprep
from tests.convert_kit import converted
from tests.kv_fixture import push_kv_out_of_fp8_range

pytestmark = pytest.mark.slow

SCALES_FILE = "kv_scales.safetensors"
# fp8 e4m3's largest finite value: absmax / FP8_MAX maps the largest value onto it
FP8_MAX = 448.0


def _cpu_quantizes_kv() -> None:
    flags = Path("/proc/cpuinfo").read_text(encoding="ascii", errors="replace").split()
    if "avx512f" not in flags and "amx_tile" not in flags:
        needs.skip("vllm", "this CPU has neither AVX-512 nor AMX: vLLM's CPU build refuses "
                   "every quantized KV cache here")


def measured_scales(out: Path) -> dict[str, float]:
    """absmax/448 of K (after rotary, as a cache holds it) and V per layer, over the
    passage, with transformers on OUT."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qwen_kvprep.convert.corpus import fixed
    from qwen_kvprep.kvjudge.passage import passage_ids

    tok = AutoTokenizer.from_pretrained(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32)
    ids = passage_ids(lambda t: list(tok.encode(t, add_special_tokens=False)), fixed(), 512)
    with torch.no_grad():
        cache = model(torch.tensor([ids]), use_cache=True).past_key_values
    scales: dict[str, float] = {}
    for i, layer in enumerate(cache.layers):
        scales[f"model.layers.{i}.self_attn.k_scale"] = float(layer.keys.abs().max()) / FP8_MAX
        scales[f"model.layers.{i}.self_attn.v_scale"] = float(layer.values.abs().max()) / FP8_MAX
    return scales


def scales_in(out: Path) -> dict[str, float]:
    """The KV scale tensors OUT holds, read from its files."""
    from safetensors import safe_open

    found: dict[str, float] = {}
    for shard in sorted(out.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for name in f.keys():  # noqa: SIM118
                if name.endswith(("self_attn.k_scale", "self_attn.v_scale")):
                    found[name] = float(f.get_tensor(name))
    assert found, f"{out} holds no KV scales"
    return found


def add_scales(out: Path, scales: dict[str, float]) -> None:
    """What llm-compressor writes for a static per-tensor fp8 KV cache: a kv_cache_scheme,
    and scalar float32 scales in a shard of their own named in the index."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    weight_map: dict[str, str] = {}
    for shard in sorted(out.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            weight_map.update({k: shard.name for k in f.keys()})  # noqa: SIM118
    save_file({k: torch.tensor(v, dtype=torch.float32) for k, v in scales.items()},
              str(out / SCALES_FILE))
    weight_map.update({k: SCALES_FILE for k in scales})
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": weight_map}))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "dense", "config_groups": {},
        "ignore": [], "kv_cache_scheme": {"num_bits": 8, "type": "float", "symmetric": True,
                                          "dynamic": False, "strategy": "tensor"}}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _record(out)


def _record(out: Path) -> None:
    """OUT's provenance.json records the files as they are now (the scales, the index and
    config.json), as a convert that writes them would."""
    from dataclasses import replace

    from qwen_kvprep.convert.reads import hash_file
    from qwen_kvprep.provenance import PROVENANCE, read

    rec = read(out)
    outputs = {p.name: hash_file(p).record for p in sorted(out.iterdir())
               if p.is_file() and p.name != PROVENANCE}
    (out / PROVENANCE).write_text(replace(rec, outputs={**rec.outputs, **outputs}).dumps())


@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, Any], Path,
                                                                      dict[str, float]]]:
    needs.vllm()
    _cpu_quantizes_kv()
    root = tmp_path_factory.mktemp("kvtable")
    src = generate_checkpoint(root / "src", layers=2, heads=2, head_dim=64, intermediate=128,
                              dtype="bf16", shards=1, config_overrides={"seq_length": 1024})
    push_kv_out_of_fp8_range(src)
    out = root / "out"
    made = kvprep("convert", str(src), str(out), "--no-verify", "--kv-cache", "fp8",
                  timeout=600)
    if made.returncode == 2 and "--kv-cache" in made.stderr:
        # a convert without calibration: the scales as it would write them, added after
        converted(src, out)
        add_scales(out, measured_scales(out))
    else:
        assert made.returncode == 0, made.stdout + made.stderr
    scales = scales_in(out)
    res = kvprep("smoke", str(out), "--engine", "vllm", "--json", "--max-new-tokens", "4",
                 timeout=900)
    yield document(res), out, scales


def _rows(doc: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(r["dtype"], r["scales"]): r for r in doc["kv_cache"]}


def test_fp8_at_scale_one_is_broken_and_with_the_folders_scales_usable(
    table: tuple[dict[str, Any], Path, dict[str, float]],
) -> None:
    doc, _out, _scales = table
    rows = _rows(doc)
    unit, calibrated = rows[("fp8_e4m3", "1.0")], rows[("fp8_e4m3", "checkpoint")]
    assert unit["accepted"] and not unit["usable"], unit
    assert calibrated["usable"], calibrated
    assert calibrated["kl_mean"] * 10 <= unit["kl_mean"]
    for row in (unit, calibrated):
        assert row["tokens_scored"] >= 400 and row["chunk"] <= 64
        assert set(row) >= {"kl_mean", "kl_p99", "top1_agree", "tokens_scored", "scales",
                            "engine_k_scale", "engine_v_scale"}
    reference = rows[("auto", "1.0")]
    assert reference["kl_mean"] == 0.0 and reference["top1_agree"] == 1.0
    # served as it is, the folder's cache is fp8 with its scales
    assert rows[("auto", "checkpoint")]["resolved"].startswith("fp8")
    best = doc["kv_cache_recommended"]
    assert best["scales"] == "checkpoint" and best["dtype"].startswith("fp8")


def test_the_engine_holds_the_folders_scales(
    table: tuple[dict[str, Any], Path, dict[str, float]],
) -> None:
    doc, _out, scales = table
    rows = _rows(doc)
    layers = len(scales) // 2
    want_k = [scales[f"model.layers.{i}.self_attn.k_scale"] for i in range(layers)]
    want_v = [scales[f"model.layers.{i}.self_attn.v_scale"] for i in range(layers)]
    row = rows[("fp8_e4m3", "checkpoint")]
    assert row["engine_k_scale"] == pytest.approx(want_k, rel=1e-6)
    assert row["engine_v_scale"] == pytest.approx(want_v, rel=1e-6)
    assert rows[("fp8_e4m3", "1.0")]["engine_k_scale"] == [1.0] * layers


def test_int8_per_token_head_is_never_usable_on_a_cpu(
    table: tuple[dict[str, Any], Path, dict[str, float]],
) -> None:
    doc, _out, _scales = table
    (row,) = [r for r in doc["kv_cache"] if r["dtype"] == "int8_per_token_head"]
    assert not row["usable"] and row["declared"] is False, row
    assert not [f for f in doc["findings"] if f["severity"] == "fail"], doc["findings"]
