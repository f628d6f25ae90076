"""What the convert tests share.

`load_source`, `load_out`, `expected_dense`, `bits_equal`, `dequantize`: the tensors of a
tiny checkpoint and of OUT read with the plain libraries, the expected Qwen2 tensors
computed independently of qwen_kvprep.convert, and GPTQ dequantization.

`qwen2_folder(src, dst)` maps a tiny Qwen (v1) checkpoint's tensors to Qwen2's names
(c_attn split in three; w2 -> gate_proj, w1 -> up_proj) into one model.safetensors and
writes a Qwen2 config.json, by a mapping of its own (the proof's tests); `corrupt` changes
it the ways the proof must catch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch

from qwen_kvprep.jsontypes import JSONObject


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


_BLOCK = {
    "ln_1": "input_layernorm",
    "ln_2": "post_attention_layernorm",
    "attn.c_proj": "self_attn.o_proj",
    "mlp.w1": "mlp.up_proj",
    "mlp.w2": "mlp.gate_proj",
    "mlp.c_proj": "mlp.down_proj",
}
_TOP = {"transformer.wte": "model.embed_tokens", "transformer.ln_f": "model.norm",
        "lm_head": "lm_head"}
_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _tensors(src: Path) -> dict[str, object]:
    from safetensors.torch import load_file

    out: dict[str, object] = {}
    for shard in sorted(src.glob("*.safetensors")):
        out.update(load_file(str(shard)))
    return out


def qwen2_folder(
    src: Path, dst: Path, *, context_factor: Optional[float] = None, rope_type: str = "dynamic"
) -> Path:
    import torch
    from safetensors.torch import save_file

    cfg: JSONObject = json.loads((src / "config.json").read_text())
    mapped: dict[str, torch.Tensor] = {}
    for name, t in _tensors(src).items():
        assert isinstance(t, torch.Tensor)
        module, _, leaf = name.rpartition(".")
        if module in _TOP:
            mapped[f"{_TOP[module]}.{leaf}"] = t
            continue
        parts = module.split(".")
        prefix, rest = f"model.layers.{parts[2]}.", ".".join(parts[3:])
        if rest == "attn.c_attn":
            for target, piece in zip(("q_proj", "k_proj", "v_proj"), t.chunk(3, dim=0)):
                mapped[f"{prefix}self_attn.{target}.{leaf}"] = piece.contiguous()
        else:
            mapped[f"{prefix}{_BLOCK[rest]}.{leaf}"] = t
    dst.mkdir(parents=True)
    save_file(mapped, str(dst / "model.safetensors"), metadata={"format": "pt"})
    dtype = next((_DTYPES[k] for k in ("bf16", "fp16", "fp32") if cfg.get(k) is True), "float32")
    seq = cfg["seq_length"]
    assert isinstance(seq, int) and isinstance(cfg["intermediate_size"], int)
    out: JSONObject = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": cfg["hidden_size"],
        "intermediate_size": cfg["intermediate_size"] // 2,
        "num_hidden_layers": cfg["num_hidden_layers"],
        "num_attention_heads": cfg["num_attention_heads"],
        "num_key_value_heads": cfg["num_attention_heads"],
        "vocab_size": cfg["vocab_size"],
        "rms_norm_eps": cfg["layer_norm_epsilon"],
        "rope_theta": cfg["rotary_emb_base"],
        "max_position_embeddings": seq,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "hidden_act": "silu",
        "use_sliding_window": False,
        "attention_dropout": 0.0,
    }
    if context_factor is not None:
        out["max_position_embeddings"] = int(seq * context_factor)
        out["rope_scaling"] = {
            "rope_type": rope_type, "type": rope_type, "factor": context_factor,
            "original_max_position_embeddings": seq,
        }
    (dst / "config.json").write_text(json.dumps(out, indent=2))
    return dst


def corrupt(out: Path, how: str) -> str:
    """Change OUT's weights: "weight" adds 1e-2 to one element of layer 0's down_proj,
    "swap-qk" exchanges layer 0's q_proj and k_proj. Returns the tensor name concerned."""
    from safetensors.torch import load_file, save_file

    path = out / "model.safetensors"
    tensors = load_file(str(path))
    if how == "weight":
        name = "model.layers.0.mlp.down_proj.weight"
        t = tensors[name].clone()
        t.view(-1)[7] += 1e-2
        tensors[name] = t
    elif how == "swap-qk":
        name = "model.layers.0.self_attn.q_proj.weight"
        k = "model.layers.0.self_attn.k_proj.weight"
        tensors[name], tensors[k] = tensors[k], tensors[name]
    else:
        raise ValueError(how)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return name
