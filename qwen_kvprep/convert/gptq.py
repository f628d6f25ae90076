"""How a GPTQ linear's packed tensors split along its output, for c_attn's q, k and v.

A GPTQ linear with `in` inputs, `out` outputs, `bits` bits and groups of `group_size`
inputs is stored as (AutoGPTQ's layout, which Qwen's Int4 repositories use):

- `qweight` int32 `[in * bits / 32, out]`: codes packed along the *input*: a column is one
  output, so an output range is a column range;
- `scales` `[groups, out]`: one column per output, split the same way;
- `qzeros` int32 `[groups, out * bits / 32]`: zero points packed along the *output*, 32 /
  bits of them per word (8 for Int4): output range [a, b) is word columns [a / 8, b / 8),
  which exists only when a and b are multiples of 8;
- `g_idx` int32 `[in]`: the group of each *input* row, the same for every output: each
  part gets a copy.

A slice of words is the exact packed form of the slice of codes: nothing is unpacked or
re-quantized, so q, k and v dequantize to exactly the rows of c_attn they were.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from qwen_kvprep.convert.pieces import Piece
from qwen_kvprep.errors import CheckpointError

PACKED_BITS = (2, 4, 8)  # 3 bits straddle word boundaries: no column slice of qzeros exists


@dataclass(frozen=True)
class GptqLayout:
    """The two fields that decide the packed tensors' shapes."""

    bits: int
    group_size: int  # -1: one group for the whole input

    @property
    def pack(self) -> int:
        return 32 // self.bits

    def groups(self, in_features: int) -> int:
        if self.group_size == -1:
            return 1
        return -(-in_features // self.group_size)


def layout(bits: int, group_size: int) -> GptqLayout:
    """The layout, or CheckpointError for a bit width whose zero points cannot be split."""
    if bits not in PACKED_BITS:
        raise CheckpointError(
            f"GPTQ with {bits} bits packs its zero points across word boundaries: they cannot "
            "be split into q, k and v without unpacking, which convert does not do",
            fix="convert a 2-, 4- or 8-bit GPTQ checkpoint, or the unquantized model",
        )
    return GptqLayout(bits, group_size)


def gptq_sources(
    prefix: str, out_features: int, in_features: int, gl: GptqLayout
) -> dict[str, tuple[int, ...]]:
    """The packed tensors of linear `prefix` with their shapes (c_attn's bias is not here:
    a bias is a plain tensor, split as the dense one)."""
    groups = gl.groups(in_features)
    return {
        f"{prefix}.qweight": (in_features * gl.bits // 32, out_features),
        f"{prefix}.qzeros": (groups, out_features * gl.bits // 32),
        f"{prefix}.scales": (groups, out_features),
        f"{prefix}.g_idx": (in_features,),
    }


def gptq_pieces(
    prefix: str, targets: Sequence[str], width: int, gl: GptqLayout
) -> list[Piece]:
    """The pieces of linear `prefix` for `targets`, each `width` outputs wide, in order.

    One target: the four tensors whole. Several (c_attn into q, k, v): CheckpointError
    unless `width` is a multiple of the words' 32 / bits zero points."""
    if len(targets) == 1:
        return [
            Piece(f"{targets[0]}.{part}", f"{prefix}.{part}")
            for part in ("qweight", "qzeros", "scales", "g_idx")
        ]
    if width % gl.pack:
        raise CheckpointError(
            f"{prefix}: each of q, k and v is {width} outputs wide, not a multiple of "
            f"{gl.pack} (the zero points one int32 of qzeros packs at {gl.bits} bits): the "
            "boundaries between them fall inside a packed word, so qzeros cannot be split "
            "exactly",
            fix="convert the unquantized model and quantize the Qwen2 output instead",
        )
    out: list[Piece] = []
    # grouped by source tensor, so that each is read once
    for part, per_word in (("qweight", 1), ("qzeros", gl.pack), ("scales", 1)):
        for k, target in enumerate(targets):
            a, b = k * width // per_word, (k + 1) * width // per_word
            out.append(Piece(f"{target}.{part}", f"{prefix}.{part}", 1, a, b))
    out.extend(Piece(f"{target}.g_idx", f"{prefix}.g_idx") for target in targets)
    return out
