"""KV cache scales a folder carries, and the same folder without them.

A folder with calibrated scales holds, as llm-compressor writes them, a `quantization_config`
in config.json whose `kv_cache_scheme` is set (no weight quantization), and scalar tensors
`model.layers.N.self_attn.k_scale` / `v_scale`. vLLM serves such a folder with an fp8 cache
by default (`auto` resolves to fp8) at those scales. To measure the same model unquantized
and at scale 1.0, the engine smoke serves a view of it: links to its files, with config.json
without `quantization_config` and the scale tensors left out (vLLM refuses scale tensors it
was not told about: "There is no module or parameter named ...k_scale").

Standard library and headers only: the parent never imports torch.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Optional

from qwen_kvprep.fsutil import atomic_write_text
from qwen_kvprep.probe.checkpoint import probe_shard
from qwen_kvprep.untrusted import read_record

SCALE_NAME = re.compile(r"^model\.layers\.\d+\.self_attn\.[kv]_scale$")
INDEX = "model.safetensors.index.json"
_MAX_JSON = 64 << 20


def _object(path: Path) -> dict[str, object]:
    data = read_record(path, _MAX_JSON)
    if not isinstance(data, dict):
        raise ValueError(f"{path.name} is not a JSON object")
    return dict(data)


def kv_scheme_only(quantization: object) -> bool:
    """The quantization_config quantizes the KV cache alone (a kv_cache_scheme, no weight
    groups): the weights are the plain ones."""
    if not isinstance(quantization, dict) or not isinstance(
            quantization.get("kv_cache_scheme"), dict):
        return False
    return quantization.get("quant_method") == "compressed-tensors" and not quantization.get(
        "config_groups")


def has_scales(config: dict[str, object]) -> bool:
    return kv_scheme_only(config.get("quantization_config"))


def unscaled_view(out: Path, dest: Path) -> Optional[str]:
    """Fill `dest` (an empty folder) with OUT as it is without its KV scales: None when done,
    else why it cannot be (a shard holds scale tensors and weights together)."""
    index: Optional[dict[str, object]] = None
    if (out / INDEX).is_file():
        index = _object(out / INDEX)
    for entry in sorted(os.listdir(out)):
        src = out / entry
        if entry == "config.json":
            config = _object(src)
            config.pop("quantization_config", None)
            atomic_write_text(dest / entry, json.dumps(config, indent=2) + "\n")
        elif entry == INDEX and index is not None:
            weight_map = index.get("weight_map")
            kept = ({k: v for k, v in weight_map.items() if not SCALE_NAME.match(str(k))}
                    if isinstance(weight_map, dict) else weight_map)
            atomic_write_text(dest / entry, json.dumps({**index, "weight_map": kept}) + "\n")
        elif entry.endswith(".safetensors") and src.is_file():
            names = probe_shard(src, entry).tensor_names
            scales = {n for n in names if SCALE_NAME.match(n)}
            if scales and scales != names:
                return (f"{entry} holds the KV scales and weights together, so the folder "
                        "cannot be served without its scales by leaving a file out")
            if not scales:
                os.symlink(src.resolve(), dest / entry)
        else:
            os.symlink(src.resolve(), dest / entry)
    return None
