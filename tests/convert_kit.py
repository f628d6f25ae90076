"""What the convert tests share.

`load_source`, `load_out`, `expected_dense`, `bits_equal`, `dequantize`: the tensors of a
tiny checkpoint and of OUT read with the plain libraries, the expected Qwen2 tensors
computed independently of qwen_kvprep.convert, and GPTQ dequantization.

`converted(src, dst)` runs convert (without its own proof, which the proof's tests call
themselves); `corrupt` changes OUT's weights the ways the proof must catch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch

from qwen_kvprep.convert.run import ConvertOptions, convert


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


def converted(
    src: Path, dst: Path, *, context_factor: Optional[float] = None,
    rope_scaling: Optional[str] = None,
) -> Path:
    options = ConvertOptions(
        verify=False, context_factor=context_factor,
        rope_scaling=rope_scaling if context_factor is not None else None,
    )
    return convert(src, dst, options).out


def _file_of(out: Path, name: str) -> Path:
    index = out / "model.safetensors.index.json"
    if index.is_file():
        return out / str(json.loads(index.read_text())["weight_map"][name])
    return out / "model.safetensors"


def corrupt(out: Path, how: str) -> str:
    """Change OUT's weights: "weight" adds 1e-2 to one element of layer 0's down_proj,
    "swap-qk" exchanges layer 0's q_proj and k_proj, "scale-o-last" multiplies the last
    layer's o_proj by 1.5. Returns the tensor name concerned."""
    from safetensors.torch import load_file, save_file

    last = json.loads((out / "config.json").read_text())["num_hidden_layers"] - 1
    name = {
        "weight": "model.layers.0.mlp.down_proj.weight",
        "scale-o-last": f"model.layers.{last}.self_attn.o_proj.weight",
    }.get(how, "model.layers.0.self_attn.q_proj.weight")
    path = _file_of(out, name)
    tensors = load_file(str(path))
    if how == "weight":
        t = tensors[name].clone()
        t.view(-1)[7] += 1e-2
        tensors[name] = t
    elif how == "scale-o-last":
        tensors[name] = tensors[name] * 1.5
    elif how == "swap-qk":
        k = "model.layers.0.self_attn.k_proj.weight"
        assert _file_of(out, k) == path
        tensors[name], tensors[k] = tensors[k], tensors[name]
    else:
        raise ValueError(how)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return name


def rerecord(out: Path) -> None:
    """Rewrite OUT's provenance.json to match OUT's files as they are now: what someone who
    changed OUT and covered the change would do; only the proof itself can catch it then."""
    import hashlib
    import os

    record = json.loads((out / "provenance.json").read_text())
    for name in record["outputs"]:
        path = out / name
        entry = {"sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                 "size": path.stat().st_size}
        if "mtime_ns" in record["outputs"][name]:
            entry["mtime_ns"] = os.stat(path).st_mtime_ns
        record["outputs"][name] = entry
    (out / "provenance.json").write_text(json.dumps(record, indent=2))


def flip_exponent_bit(out: Path, name: str = "lm_head.weight", index: int = 5) -> None:
    """Flip the top exponent bit of one element of `name` (a weight of ~0.02 becomes
    ~7e36), the file's modification time kept, as bit rot leaves it."""
    import os

    from safetensors.torch import load_file, save_file

    path = _file_of(out, name)
    st = path.stat()
    tensors = load_file(str(path))
    t = tensors[name].clone()
    bits = {torch.float32: (torch.int32, 1 << 30), torch.bfloat16: (torch.int16, 1 << 14),
            torch.float16: (torch.int16, 1 << 14)}
    as_int, bit = bits[t.dtype]
    flat = t.view(-1).view(as_int)
    flat[index] ^= bit
    tensors[name] = t
    save_file(tensors, str(path), metadata={"format": "pt"})
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
