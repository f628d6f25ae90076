"""GPTQ Int4 packing for tiny checkpoints, in the layout Qwen's `-Int4` repositories ship.

Qwen's Int4 checkpoints were made with AutoGPTQ: every linear layer inside a block
(`attn.c_attn`, `attn.c_proj`, `mlp.w1`, `mlp.w2`, `mlp.c_proj`) is replaced by four
tensors, its bias (where the layer has one) kept beside them; embeddings, norms and
`lm_head` stay plain fp16. For a layer `y = x @ W.T + b` with W `[out, in]`, bits 4 and
group size g (G = in / g groups, `g_idx[i] = i // g` without act-order):

- `qweight` int32 `[in / 8, out]`: the 4-bit codes q[i, o] packed along the *input*
  dimension, eight per int32, input row i in bits `4 * (i % 8)` of word `i // 8`;
- `qzeros` int32 `[G, out / 8]`: the zero points packed along the *output* dimension,
  output column o in bits `4 * (o % 8)` of word `o // 8`, stored as **zero - 1** (the
  "v1" format, `checkpoint_format: "gptq"`; loaders add the 1 back when they convert to
  their internal v2 format);
- `scales` fp16 `[G, out]`;
- `g_idx` int32 `[in]`: the group of each input row.

The weight is `W[o, i] = scales[g_idx[i], o] * (q[i, o] - zero[g_idx[i], o])`. Symmetric
quantization (`sym: true`) fixes the zero at 8 for 4 bits (so qzeros words are 0x77777777)
and sets each group's scale from its largest magnitude: `scale = 2 * max|w| / 15`,
`q = clamp(round(w / scale) + 8, 0, 15)`.

The tiny checkpoints round to nearest (no calibration data, no Hessian): the *format* is
exactly GPTQ's, which is what loaders and qwen-kvprep depend on; the rounding is what a
GPTQ run with no calibration would degrade to.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qwen_kvprep.errors import UsageError
from qwen_kvprep.jsontypes import JSONObject

if TYPE_CHECKING:
    import torch

BITS = 4
GROUP_SIZE = 128
PACK = 32 // BITS  # codes per int32
MAXQ = (1 << BITS) - 1
SYM_ZERO = (MAXQ + 1) // 2  # 8: the zero point of symmetric 4-bit quantization

# The block linears Qwen's Int4 repositories quantize, as suffixes of `transformer.h.N.`.
QUANTIZED_LINEARS = ("attn.c_attn", "attn.c_proj", "mlp.w1", "mlp.w2", "mlp.c_proj")

# What Qwen's Int4 repositories ship as quantize_config.json; config.json's
# quantization_config is the same plus `quant_method: "gptq"`.
QUANTIZE_CONFIG: JSONObject = {
    "bits": BITS,
    "group_size": GROUP_SIZE,
    "damp_percent": 0.01,
    "desc_act": False,
    "static_groups": False,
    "sym": True,
    "true_sequential": True,
    "model_name_or_path": None,
    "model_file_base_name": "model",
}


def check_shape(name: str, out_features: int, in_features: int) -> None:
    """Raise UsageError unless a `[out, in]` weight packs with bits 4 and group size 128."""
    if in_features % GROUP_SIZE or out_features % PACK:
        raise UsageError(
            f"GPTQ tiny checkpoints need every quantized layer's input width to be a multiple "
            f"of the group size {GROUP_SIZE} (the group size Qwen's Int4 repositories use) and "
            f"its output width a multiple of {PACK}; {name} is [{out_features}, {in_features}]: "
            "choose heads * head_dim and intermediate / 2 as multiples of 128"
        )


def quantize(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """Round-to-nearest symmetric 4-bit GPTQ tensors of a `[out, in]` weight (v1 format)."""
    import torch

    out_features, in_features = weight.shape
    check_shape("the weight", out_features, in_features)
    groups = in_features // GROUP_SIZE
    w = weight.detach().to(torch.float32).T.contiguous()  # [in, out], GPTQ's orientation
    by_group = w.reshape(groups, GROUP_SIZE, out_features)
    amax = by_group.abs().amax(dim=1)  # [G, out]
    # a group of zeros would divide by zero (any positive scale represents it exactly); a
    # scale below fp16's smallest normal would lose its precision
    tiny = torch.finfo(torch.float16).tiny
    scales = torch.where(amax > 0, (2 * amax / MAXQ).clamp(min=tiny), torch.ones_like(amax))
    scales = scales.to(torch.float16)
    # quantize with the fp16 scales the loader will use, so dequantization is exact
    codes = torch.clamp(
        torch.round(by_group / scales.to(torch.float32)[:, None, :]) + SYM_ZERO, 0, MAXQ
    ).to(torch.int32)
    codes = codes.reshape(in_features, out_features)
    zeros = torch.full((groups, out_features), SYM_ZERO, dtype=torch.int32)
    return {
        "qweight": _pack_rows(codes),
        "qzeros": _pack_rows((zeros - 1).T.contiguous()).T.contiguous(),
        "scales": scales,
        "g_idx": torch.arange(in_features, dtype=torch.int32) // GROUP_SIZE,
    }


def _pack_rows(codes: torch.Tensor) -> torch.Tensor:
    """`[n, m]` codes in 0..15 -> `[n / 8, m]` int32, row r in bits 4 * (r % 8) of word r // 8."""
    import torch

    n, m = codes.shape
    parts = codes.to(torch.int64).reshape(n // PACK, PACK, m)
    shifts = torch.arange(0, 32, BITS, dtype=torch.int64)[None, :, None]
    words = (parts << shifts).sum(dim=1)  # disjoint bit fields: the sum is their OR
    # into int32 two's complement: a code >= 8 in the top nibble sets the sign bit
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)
    return words.to(torch.int32)


def quantize_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` with every block linear's `.weight` replaced by its GPTQ tensors.

    The order is kept (each linear's four tensors where its weight was); everything else
    (biases, norms, embeddings, lm_head) is cast to fp16, the dtype GPTQ models run in.
    """
    import torch

    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        prefix = name[: -len(".weight")] if name.endswith(".weight") else None
        if prefix is not None and prefix.startswith("transformer.h.") and prefix.endswith(
            tuple("." + s for s in QUANTIZED_LINEARS)
        ):
            check_shape(prefix, *tensor.shape)
            for key, value in quantize(tensor).items():
                out[f"{prefix}.{key}"] = value
        else:
            out[name] = tensor.to(torch.float16).contiguous()
    return out
