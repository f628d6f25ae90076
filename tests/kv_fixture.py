"""A tiny checkpoint whose K and V run past fp8 e4m3's range, with its function unchanged.

`push_kv_out_of_fp8_range(ckpt, exponent)`: in a tiny Qwen (v1) checkpoint (safetensors,
one file or shards), multiply the k and v thirds of every `attn.c_attn` weight and bias by
2**exponent, and divide the q third and `attn.c_proj` by it. Attention scores (q.k) and the
attention output (softmax . V through c_proj) are unchanged, and powers of two are exact in
bf16 and fp16 (away from overflow), so the logits are the original's; but K and V, as an
engine caches them, are 2**exponent larger: past fp8 e4m3's largest finite value (448) for
the default exponent, where a cache quantized at scale 1.0 saturates and one with calibrated
scales does not.
"""

from __future__ import annotations

import json
from pathlib import Path


def _shards(checkpoint_dir: Path) -> list[Path]:
    index = checkpoint_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [checkpoint_dir / str(name) for name in names]
    single = checkpoint_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise ValueError(f"{checkpoint_dir} holds no safetensors weights")


def push_kv_out_of_fp8_range(checkpoint_dir: Path, exponent: int = 12) -> None:
    """Scale K and V up by 2**exponent and q and the attention's output projection down by
    it, in place, in every shard of `checkpoint_dir` (a non-GPTQ tiny Qwen v1 checkpoint)."""
    from safetensors.torch import load_file, save_file

    checkpoint_dir = Path(checkpoint_dir)
    factor = 2.0 ** exponent
    changed = 0
    for path in _shards(checkpoint_dir):
        tensors = load_file(str(path))
        touched = False
        for name in list(tensors):
            if name.endswith(".attn.c_attn.qweight"):
                raise ValueError(f"{checkpoint_dir} is GPTQ: its c_attn is packed, not scalable")
            if name.endswith(".attn.c_attn.weight") or name.endswith(".attn.c_attn.bias"):
                t = tensors[name].clone()
                third = t.shape[0] // 3
                t[:third] /= factor  # q
                t[third:] *= factor  # k and v
                tensors[name] = t
            elif name.endswith(".attn.c_proj.weight"):
                tensors[name] = tensors[name] / factor
            else:
                continue
            touched = True
            changed += 1
        if touched:
            mode = path.stat().st_mode & 0o777
            save_file(tensors, str(path), metadata={"format": "pt"})
            path.chmod(mode)
    if changed == 0:
        raise ValueError(f"{checkpoint_dir} has no attn.c_attn / attn.c_proj weights")
