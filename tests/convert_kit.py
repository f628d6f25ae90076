"""What the convert tests share: tiny checkpoints made once per session, the expected
Qwen2 tensors computed independently of qwen_kvprep.convert, and GPTQ dequantization."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def load_source(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a tiny checkpoint, read with the plain libraries."""
    out: dict[str, torch.Tensor] = {}
    for path in sorted(ckpt.iterdir()):
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            out.update(load_file(str(path)))
        elif path.suffix == ".bin":
            out.update(torch.load(str(path), map_location="cpu", weights_only=True))
    return out


def load_out(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


def expected_dense(src: dict[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    """The Qwen2 tensors, written out by hand from the mapping's definition."""
    exp = {
        "model.embed_tokens.weight": src["transformer.wte.weight"],
        "model.norm.weight": src["transformer.ln_f.weight"],
        "lm_head.weight": src["lm_head.weight"],
    }
    for i in range(layers):
        s, d = f"transformer.h.{i}.", f"model.layers.{i}."
        w, b = src[s + "attn.c_attn.weight"], src[s + "attn.c_attn.bias"]
        h = w.shape[0] // 3
        for k, name in enumerate(("q_proj", "k_proj", "v_proj")):
            exp[f"{d}self_attn.{name}.weight"] = w[k * h : (k + 1) * h]
            exp[f"{d}self_attn.{name}.bias"] = b[k * h : (k + 1) * h]
        exp[d + "self_attn.o_proj.weight"] = src[s + "attn.c_proj.weight"]
        exp[d + "mlp.gate_proj.weight"] = src[s + "mlp.w2.weight"]
        exp[d + "mlp.up_proj.weight"] = src[s + "mlp.w1.weight"]
        exp[d + "mlp.down_proj.weight"] = src[s + "mlp.c_proj.weight"]
        exp[d + "input_layernorm.weight"] = src[s + "ln_1.weight"]
        exp[d + "post_attention_layernorm.weight"] = src[s + "ln_2.weight"]
    return exp


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


def dequantize(t: dict[str, Any], prefix: str, group_size: int = 128) -> torch.Tensor:
    """W [out, in] of a 4-bit GPTQ linear (v1 zero points), from its packed tensors."""
    qweight, qzeros = t[prefix + ".qweight"], t[prefix + ".qzeros"]
    scales, g_idx = t[prefix + ".scales"].float(), t[prefix + ".g_idx"].long()
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    codes = ((qweight.to(torch.int64)[:, None, :] >> shifts[None, :, None]) & 15).reshape(
        -1, qweight.shape[1]
    )  # [in, out]
    zeros = ((qzeros.to(torch.int64)[:, :, None] >> shifts[None, None, :]) & 15).reshape(
        qzeros.shape[0], -1
    ) + 1  # [G, out]
    w = scales[g_idx] * (codes.float() - zeros[g_idx].float())
    return w.T.contiguous()
