"""The KV scales in OUT, in the shape llm-compressor writes them, which vLLM and SGLang load:

- config.json `quantization_config`: `quant_method` "compressed-tensors", no weight
  scheme (`config_groups` empty, format "dense": the weights stay as they are), and a
  `kv_cache_scheme`: 8-bit float, symmetric, static, one scale per tensor;
- per layer, one-element float32 tensors (shape [1]) `model.layers.N.self_attn.k_scale`
  and `v_scale`, here in a shard of their own (SCALES_FILE) named in
  model.safetensors.index.json (made where OUT had one shard and no index).

Per-head scales are not written: vLLM's compressed-tensors loader takes per-tensor scales
on every attention backend (strategy "attn_head" only on some GPU backends), SGLang and
vLLM's CPU backend per-tensor only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from qwen_kvprep.jsontypes import JSON, JSONObject

SCALES_FILE = "kv-cache-scales.safetensors"
SINGLE_FILE = "model.safetensors"
INDEX = "model.safetensors.index.json"
QUANT_METHOD = "compressed-tensors"
# as llm-compressor 0.14 / compressed-tensors 0.19 write it (bench/kv_scales_llmcompressor.py)
KV_CACHE_SCHEME: JSONObject = {
    "actorder": None,
    "block_structure": None,
    "dynamic": False,
    "group_size": None,
    "num_bits": 8,
    "observer": None,
    "observer_kwargs": {},
    "scale_dtype": None,
    "strategy": "tensor",
    "symmetric": True,
    "type": "float",
    "zp_dtype": None,
}
_NAME = re.compile(r"model\.layers\.(\d+)\.self_attn\.([kv])_scale")


def k_name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.k_scale"


def v_name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.v_scale"


def quantization_config() -> JSONObject:
    """What config.json's quantization_config says for a KV-cache-only scheme."""
    return {
        "config_groups": {},
        "format": "dense",
        "global_compression_ratio": None,
        "ignore": [],
        "kv_cache_scheme": dict(KV_CACHE_SCHEME),
        "quant_method": QUANT_METHOD,
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
    }


def declares_kv_scales(config: JSON) -> bool:
    """Whether a config.json (parsed) declares a compressed-tensors fp8 KV cache scheme."""
    if not isinstance(config, dict):
        return False
    q = config.get("quantization_config")
    if not isinstance(q, dict) or q.get("quant_method") != QUANT_METHOD:
        return False
    scheme = q.get("kv_cache_scheme")
    return isinstance(scheme, dict) and scheme.get("type") == "float" and scheme.get(
        "num_bits") == 8


def without_kv_scheme(config: JSONObject) -> JSONObject:
    """config.json as the plain convert wrote it: our quantization_config taken out."""
    if declares_kv_scales(config):
        return {k: v for k, v in config.items() if k != "quantization_config"}
    return dict(config)


def with_kv_scheme(config: JSONObject) -> JSONObject:
    out = without_kv_scheme(config)
    if "quantization_config" in out:  # GPTQ weights: not a scheme this file can join
        raise ValueError("config.json already holds a quantization_config")
    out["quantization_config"] = quantization_config()
    return out


def scales_tensors(k: Sequence[float], v: Sequence[float]) -> dict[str, object]:
    import torch

    if len(k) != len(v):
        raise ValueError(f"{len(k)} K scales against {len(v)} V scales")
    out: dict[str, object] = {}
    for i, (ks, vs) in enumerate(zip(k, v)):
        out[k_name(i)] = torch.tensor([ks], dtype=torch.float32)
        out[v_name(i)] = torch.tensor([vs], dtype=torch.float32)
    return out


def read_scales(out: Path) -> Optional[list[tuple[float, float]]]:
    """Each layer's (k_scale, v_scale) from OUT's SCALES_FILE; None when OUT has none.
    ValueError when the file holds anything but one scalar of each per layer, in order."""
    from safetensors import safe_open

    path = out / SCALES_FILE
    if not path.is_file():
        return None
    found: dict[tuple[int, str], float] = {}
    with safe_open(str(path), framework="pt") as fh:
        for name in fh.keys():  # noqa: SIM118 (safe_open is no mapping)
            m = _NAME.fullmatch(name)
            t = fh.get_tensor(name)
            if m is None or t.numel() != 1:
                raise ValueError(f"{path.name} holds {name} {list(t.shape)}: not a KV scale")
            found[(int(m.group(1)), m.group(2))] = float(t.reshape(-1)[0])
    layers = len(found) // 2
    if any((i, w) not in found for i in range(layers) for w in "kv") or len(found) % 2:
        raise ValueError(f"{path.name} does not hold one k_scale and one v_scale per layer")
    return [(found[(i, "k")], found[(i, "v")]) for i in range(layers)]


def index_with_scales(index: Optional[JSONObject], single: Optional[dict[str, int]],
                      layers: int, scales_size: int) -> JSONObject:
    """OUT's index with the scales' names added (made from the single shard's tensor
    names and data size `single` where OUT had no index)."""
    if index is None:
        if single is None:
            raise ValueError("neither an index nor a single shard")
        weight_map: dict[str, JSON] = {n: SINGLE_FILE for n in sorted(single)}
        total = sum(single.values()) + scales_size
        meta: JSONObject = {"total_size": total}
    else:
        raw_map = index.get("weight_map")
        if not isinstance(raw_map, dict):
            raise ValueError(f"{INDEX} has no weight_map")
        weight_map = {k: v for k, v in raw_map.items() if v != SCALES_FILE}
        raw_meta = index.get("metadata")
        meta = dict(raw_meta) if isinstance(raw_meta, dict) else {}
        before = meta.get("total_size")
        meta["total_size"] = (before if isinstance(before, int) else 0) + scales_size
    for i in range(layers):
        weight_map[k_name(i)] = SCALES_FILE
        weight_map[v_name(i)] = SCALES_FILE
    return {"metadata": meta, "weight_map": dict(sorted(weight_map.items()))}


def dumps(data: JSONObject) -> str:
    """JSON as convert writes its files (so a file rewritten here hashes as convert's)."""
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"
