"""Qwen (v1) tensor names to Qwen2's: the plan, checked against the config before any write.

Pure: names, shapes and dtypes in, a `Plan` out; no file is read here. Qwen v1's block is
Qwen2's with other names, the attention's three projections fused in one `c_attn`:

    transformer.wte.weight                 -> model.embed_tokens.weight
    transformer.h.N.ln_1.weight            -> model.layers.N.input_layernorm.weight
    transformer.h.N.attn.c_attn.{weight,bias}
                                           -> model.layers.N.self_attn.{q,k,v}_proj.*
                                              (rows [0, P), [P, 2P), [2P, 3P), P = heads
                                              * kv_channels: q, then k, then v)
    transformer.h.N.attn.c_proj.weight     -> model.layers.N.self_attn.o_proj.weight
    transformer.h.N.ln_2.weight            -> model.layers.N.post_attention_layernorm.weight
    transformer.h.N.mlp.w2.weight          -> model.layers.N.mlp.gate_proj.weight
    transformer.h.N.mlp.w1.weight          -> model.layers.N.mlp.up_proj.weight
    transformer.h.N.mlp.c_proj.weight      -> model.layers.N.mlp.down_proj.weight
    transformer.ln_f.weight                -> model.norm.weight
    lm_head.weight                         -> lm_head.weight

Qwen v1's MLP computes `c_proj(w1(x) * silu(w2(x)))` and Qwen2's `down(up(x) * silu(gate(x)))`:
w2 is the gate, w1 the up projection. A GPTQ checkpoint replaces each block linear's
`weight` by `qweight`, `qzeros`, `scales` and `g_idx` (see convert/gptq.py for how those
split).

Every tensor the config implies must be present with its shape, and nothing else may be:
an unknown tensor (a bias the config says is absent, a leftover `rotary_emb.inv_freq`...)
would be silently dropped by a name mapping, and the output would not be the model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

from qwen_kvprep.convert.gptq import GptqLayout, gptq_pieces, gptq_sources
from qwen_kvprep.convert.pieces import Piece, TensorInfo
from qwen_kvprep.errors import CheckpointError
from qwen_kvprep.jsontypes import JSON

# A Qwen v1 block linear's name under `transformer.h.N.` and its Qwen2 name under
# `model.layers.N.` (c_attn is split in three: see Q_K_V).
LINEARS: Mapping[str, str] = {
    "attn.c_proj": "self_attn.o_proj",
    "mlp.w2": "mlp.gate_proj",
    "mlp.w1": "mlp.up_proj",
    "mlp.c_proj": "mlp.down_proj",
}
C_ATTN = "attn.c_attn"
Q_K_V = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
NORMS: Mapping[str, str] = {
    "ln_1.weight": "input_layernorm.weight",
    "ln_2.weight": "post_attention_layernorm.weight",
}


@dataclass(frozen=True)
class QwenDims:
    """The dimensions the config declares, as the tensors must have them."""

    layers: int
    heads: int
    head_dim: int  # kv_channels
    hidden: int
    ff: int  # the MLP's real width: Qwen v1's intermediate_size // 2
    vocab: int

    @property
    def projection(self) -> int:
        return self.heads * self.head_dim


@dataclass(frozen=True)
class Plan:
    """Every output tensor in order, and the source tensor each comes from."""

    pieces: tuple[Piece, ...]
    sources: Mapping[str, TensorInfo]

    def by_source(self) -> dict[str, list[Piece]]:
        out: dict[str, list[Piece]] = {}
        for piece in self.pieces:
            out.setdefault(piece.source, []).append(piece)
        return out


def _positive_int(config: Mapping[str, JSON], key: str, where: str) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CheckpointError(
            f"{where}: {key} is {value!r}, not a positive integer: the tensors' shapes cannot "
            "be checked against it",
            fix="restore the checkpoint's original config.json",
        )
    return value


def model_shape(config: Mapping[str, JSON], where: str = "config.json") -> QwenDims:
    """The dimensions of a Qwen v1 config; CheckpointError for what Qwen2 cannot express."""
    layers = _positive_int(config, "num_hidden_layers", where)
    heads = _positive_int(config, "num_attention_heads", where)
    hidden = _positive_int(config, "hidden_size", where)
    head_dim = config.get("kv_channels", 128)  # QWenConfig's default when the key is absent
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0:
        raise CheckpointError(f"{where}: kv_channels is {head_dim!r}, not a positive integer")
    intermediate = _positive_int(config, "intermediate_size", where)
    vocab = _positive_int(config, "vocab_size", where)
    if heads * head_dim != hidden:
        raise CheckpointError(
            f"{where}: num_attention_heads * kv_channels = {heads} * {head_dim} = "
            f"{heads * head_dim}, not hidden_size {hidden}: Qwen2's attention has no room for "
            "a projection width other than the hidden size, so this model has no exact Qwen2 "
            "form"
        )
    if intermediate % 2:
        raise CheckpointError(
            f"{where}: intermediate_size {intermediate} is odd: Qwen v1 splits it in two "
            "halves (w1 and w2), so it must be even"
        )
    rotary = config.get("rotary_pct", 1.0)
    if rotary != 1.0 and rotary != 1:
        raise CheckpointError(
            f"{where}: rotary_pct is {rotary!r}: Qwen2 rotates every channel of a head (1.0), "
            "so this model has no exact Qwen2 form"
        )
    if config.get("no_bias", True) is not True:
        raise CheckpointError(
            f"{where}: no_bias is {config.get('no_bias')!r}: Qwen2 has biases on q, k and v "
            "only (Qwen v1's no_bias: true), so this model has no exact Qwen2 form"
        )
    return QwenDims(layers, heads, head_dim, hidden, intermediate // 2, vocab)


def _dense_sources(s: QwenDims) -> dict[str, tuple[int, ...]]:
    """Every tensor a dense checkpoint of shape `s` holds, with its shape."""
    h, p = s.hidden, s.projection
    out: dict[str, tuple[int, ...]] = {"transformer.wte.weight": (s.vocab, h)}
    for i in range(s.layers):
        b = f"transformer.h.{i}."
        out[b + "ln_1.weight"] = (h,)
        out[b + "attn.c_attn.weight"] = (3 * p, h)
        out[b + "attn.c_attn.bias"] = (3 * p,)
        out[b + "attn.c_proj.weight"] = (h, p)
        out[b + "ln_2.weight"] = (h,)
        out[b + "mlp.w2.weight"] = (s.ff, h)
        out[b + "mlp.w1.weight"] = (s.ff, h)
        out[b + "mlp.c_proj.weight"] = (h, s.ff)
    out["transformer.ln_f.weight"] = (h,)
    out["lm_head.weight"] = (s.vocab, h)
    return out


def _linear_shapes(s: QwenDims) -> dict[str, tuple[int, int]]:
    """(out, in) of each block linear, by its name under `transformer.h.N.`."""
    return {
        C_ATTN: (3 * s.projection, s.hidden),
        "attn.c_proj": (s.hidden, s.projection),
        "mlp.w2": (s.ff, s.hidden),
        "mlp.w1": (s.ff, s.hidden),
        "mlp.c_proj": (s.hidden, s.ff),
    }


def expected_sources(
    s: QwenDims, gptq: Optional[GptqLayout] = None
) -> dict[str, tuple[int, ...]]:
    """Every source tensor the config implies, in model order, with its shape."""
    dense = _dense_sources(s)
    if gptq is None:
        return dense
    out: dict[str, tuple[int, ...]] = {}
    linears = _linear_shapes(s)
    for name, shape in dense.items():
        block = _block_linear(name)
        if block is None:
            out[name] = shape
            continue
        prefix, linear = block
        out.update(gptq_sources(prefix, *linears[linear], gptq))
    return out


def _block_linear(name: str) -> Optional[tuple[str, str]]:
    """(`transformer.h.N.<linear>`, `<linear>`) for a block linear's weight, else None."""
    if not name.startswith("transformer.h.") or not name.endswith(".weight"):
        return None
    rest = name[len("transformer.h.") : -len(".weight")]
    _, _, linear = rest.partition(".")
    if linear == C_ATTN or linear in LINEARS:
        return name[: -len(".weight")], linear
    return None


def _dense_pieces(s: QwenDims) -> list[Piece]:
    p = s.projection
    out = [Piece("model.embed_tokens.weight", "transformer.wte.weight")]
    for i in range(s.layers):
        src, dst = f"transformer.h.{i}.", f"model.layers.{i}."
        out.append(Piece(dst + NORMS["ln_1.weight"], src + "ln_1.weight"))
        for part in ("weight", "bias"):
            for k, name in enumerate(Q_K_V):
                out.append(
                    Piece(f"{dst}{name}.{part}", f"{src}{C_ATTN}.{part}", 0, k * p, (k + 1) * p)
                )
        out.append(Piece(dst + "self_attn.o_proj.weight", src + "attn.c_proj.weight"))
        out.append(Piece(dst + NORMS["ln_2.weight"], src + "ln_2.weight"))
        for linear in ("mlp.w2", "mlp.w1", "mlp.c_proj"):
            out.append(Piece(f"{dst}{LINEARS[linear]}.weight", f"{src}{linear}.weight"))
    out.append(Piece("model.norm.weight", "transformer.ln_f.weight"))
    out.append(Piece("lm_head.weight", "lm_head.weight"))
    return out


def _pieces(s: QwenDims, gptq: Optional[GptqLayout]) -> list[Piece]:
    if gptq is None:
        return _dense_pieces(s)
    out: list[Piece] = []
    p = s.projection
    for piece in _dense_pieces(s):
        block = _block_linear(piece.source)
        if block is None:
            out.append(piece)
            continue
        prefix, linear = block
        target = piece.target[: -len(".weight")]
        if linear == C_ATTN:
            if piece.start == 0:  # the q piece stands for all three: split once
                names = [target[: -len("q_proj")] + n.split(".")[-1] for n in Q_K_V]
                out.extend(gptq_pieces(prefix, names, p, gptq))
            continue
        out.extend(gptq_pieces(prefix, [target], _linear_shapes(s)[linear][0], gptq))
    return out


def plan(
    config: Mapping[str, JSON],
    found: Mapping[str, TensorInfo],
    gptq: Optional[GptqLayout] = None,
    where: str = "config.json",
) -> Plan:
    """The mapping of the tensors `found` in the checkpoint, every one checked against
    `config` (CheckpointError naming the first tensor that is missing, unknown or of another
    shape, and how many more there are)."""
    s = model_shape(config, where)
    expected = expected_sources(s, gptq)
    missing = [n for n in expected if n not in found]
    unknown = sorted(n for n in found if n not in expected)
    wrong = [n for n, shape in expected.items() if n in found and found[n].shape != shape]
    problems: list[str] = []
    if missing:
        problems.append(_some(missing, "is missing", "are missing"))
    if unknown:
        problems.append(
            _some(unknown, "is not a tensor of this model", "are not tensors of this model")
            + " (the mapping would drop it)"
        )
    for name in wrong[:3]:
        problems.append(
            f"{name} has shape {list(found[name].shape)}, the config implies "
            f"{list(expected[name])}"
        )
    if len(wrong) > 3:
        problems.append(f"and {len(wrong) - 3} more tensors have another shape")
    if problems:
        raise CheckpointError(
            f"the weights do not match {where} (layers {s.layers}, hidden {s.hidden}, heads "
            f"{s.heads} x {s.head_dim}, MLP {s.ff}, vocabulary {s.vocab}): "
            + "; ".join(problems),
            fix="re-download the checkpoint's weights and config.json from the same revision "
            "(nothing was written)",
        )
    pieces = _pieces(s, gptq)
    return Plan(tuple(pieces), {n: found[n] for n in expected})


def _some(names: Sequence[str], one: str, many: str) -> str:
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"{shown} {one if len(names) == 1 else many}"
