"""config.json for Qwen2ForCausalLM, from a Qwen v1 config: no remote code, no auto_map.

Field by field (Qwen v1 -> Qwen2):

    hidden_size, num_hidden_layers, num_attention_heads, vocab_size   kept (vocab_size is
                                     the embedding's padded row count, as the tensors have it)
    intermediate_size                halved: Qwen v1 gives twice the MLP width (w1 and w2
                                     are each intermediate_size / 2 wide)
    num_key_value_heads              = num_attention_heads (Qwen v1 has no grouped queries)
    rotary_emb_base                  -> rope_theta
    layer_norm_epsilon               -> rms_norm_eps
    seq_length                       -> max_position_embeddings: Qwen v1 switches on dynamic
                                     NTK and logn attention past it, which Qwen2 does not
                                     have, so the output is exact up to seq_length tokens
    bf16 / fp16 / fp32               -> torch_dtype (and `dtype`, transformers 5's name);
                                     none set ("auto"): the dtype the tensors are stored in
    quantization_config              kept for GPTQ (quantize_config.json's when config.json
                                     has none), with checkpoint_format "gptq"

`context_factor` F with `rope_scaling` "yarn" or "dynamic" extends the context the way the
engines do for Qwen2: rope_scaling carries both spellings of the kind ("type" for
transformers 4.37..4.44 and vLLM, "rope_type" for newer transformers) and the factor.
Yarn: original_max_position_embeddings = seq_length in rope_scaling and
max_position_embeddings = seq_length * F (transformers and vLLM read it so). Dynamic NTK:
transformers and vLLM take max_position_embeddings itself as the trained length and scale
past it (vLLM serves up to it times F), so it stays seq_length and rope_scaling has no
original length (transformers refuses the key there). Past seq_length such an output is no
longer Qwen v1's model (see run.py's message).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import Optional

from qwen_kvprep.convert.mapping import QwenDims
from qwen_kvprep.errors import CheckpointError, UsageError
from qwen_kvprep.jsontypes import JSON, JSONObject

ROPE_KINDS = ("yarn", "dynamic")
_FLAG_DTYPES = (("bf16", "bfloat16"), ("fp16", "float16"), ("fp32", "float32"))


@dataclass(frozen=True)
class ContextPlan:
    """How far OUT's positions go, and whether past seq_length it is Qwen v1's model."""

    seq_length: int
    factor: Optional[float] = None
    rope_scaling: Optional[str] = None

    @property
    def serving_length(self) -> int:
        """The longest sequence OUT is meant for: seq_length, or seq_length * F."""
        if self.factor is None:
            return self.seq_length
        return int(self.seq_length * self.factor)

    @property
    def max_positions(self) -> int:
        """config.json's max_position_embeddings. Dynamic NTK (transformers, vLLM) takes
        that field as the length the model was trained for and scales past it: it stays
        seq_length. Yarn reads the trained length from rope_scaling and the field is the
        extended one."""
        if self.rope_scaling == "dynamic":
            return self.seq_length
        return self.serving_length

    @property
    def exact_up_to(self) -> Optional[int]:
        """The length up to which OUT computes Qwen v1's logits (in transformers): None
        with yarn, which rescales the rotary angles of every position, the first ones too.
        transformers' dynamic NTK changes nothing up to max_position_embeddings."""
        return None if self.rope_scaling == "yarn" else self.seq_length

    @property
    def exact_words(self) -> str:
        if self.rope_scaling == "yarn":
            return "exact at no length: yarn rescales the rotary angles of every position"
        if self.rope_scaling == "dynamic":
            # vLLM and SGLang compute one rotary base for seq_length x F and use it from
            # the first position on; transformers scales only past max_position_embeddings
            return (
                f"exact up to {self.seq_length:,} tokens in transformers (its dynamic NTK "
                "starts past that); exact at no length in vLLM and SGLang, which apply the "
                "extended rotary base at every position"
            )
        return f"exact up to {self.seq_length:,} tokens"

    def caveat(self) -> Optional[str]:
        """What a context factor costs, for convert's warning; None without one."""
        if self.factor is None:
            return None
        past = (
            f"past {self.seq_length:,} tokens it is not Qwen v1's model either (Qwen's code "
            "uses dynamic NTK and logn attention there, which Qwen2 does not have)"
        )
        return (
            f"OUT is meant for {self.serving_length:,} tokens with {self.rope_scaling} rope "
            f"scaling (factor {self.factor:g}): it is {self.exact_words}; {past}"
        )


def context(
    config: Mapping[str, JSON], factor: Optional[float], rope_scaling: Optional[str]
) -> ContextPlan:
    """The context the options ask for (UsageError for a half-given or bad option)."""
    seq = config.get("seq_length", config.get("max_position_embeddings"))
    if isinstance(seq, bool) or not isinstance(seq, int) or seq <= 0:
        raise CheckpointError(
            f"config.json: seq_length is {seq!r}, not a positive integer: the length up to "
            "which the output is exact is unknown",
            fix="restore the checkpoint's original config.json",
        )
    if (factor is None) != (rope_scaling is None):
        raise UsageError(
            "--context-factor and --rope-scaling go together: give both (e.g. "
            "`--context-factor 2 --rope-scaling yarn`) or neither (exact, the default)"
        )
    if factor is not None and not 1 < factor < math.inf:  # nan fails both comparisons
        raise UsageError(f"--context-factor {factor}: a finite number more than 1")
    if rope_scaling is not None and rope_scaling not in ROPE_KINDS:
        raise UsageError(f"--rope-scaling {rope_scaling}: one of {', '.join(ROPE_KINDS)}")
    return ContextPlan(seq, factor, rope_scaling)


def declared_dtype(config: Mapping[str, JSON], stored: str, gptq: bool) -> str:
    """The dtype the checkpoint declares: its one true flag, else the stored tensors'."""
    if gptq:
        return "float16"  # GPTQ kernels run in fp16, as Qwen's Int4 configs declare
    on = [name for flag, name in _FLAG_DTYPES if config.get(flag) is True]
    if len(on) > 1:
        raise CheckpointError(
            f"config.json sets more than one of bf16, fp16, fp32 ({', '.join(on)}): Qwen's "
            "own code refuses that, so the checkpoint's dtype is unknown",
            fix="set exactly one of them to true in the checkpoint's config.json",
        )
    return on[0] if on else stored


def _number(config: Mapping[str, JSON], key: str, default: float) -> float:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise CheckpointError(f"config.json: {key} is {value!r}, not a positive number")
    return value


def _token_id(*values: JSON) -> Optional[int]:
    for value in values:
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None


def qwen2_config(
    config: Mapping[str, JSON],
    shape: QwenDims,
    ctx: ContextPlan,
    dtype: str,
    *,
    generation: Optional[Mapping[str, JSON]] = None,
    quantization: Optional[JSONObject] = None,
    end_of_text: Optional[int] = None,
) -> JSONObject:
    """The Qwen2 config.json object. `generation`: DIR's generation_config.json (where the
    end-of-text id lives in Qwen v1 checkpoints); `end_of_text`: <|endoftext|>'s id in
    qwen.tiktoken, the id OUT's generation_config.json stops on where DIR has none;
    `quantization`: the GPTQ config to keep."""
    gen = generation or {}
    eos = _token_id(config.get("eos_token_id"), gen.get("eos_token_id"),
                    end_of_text if end_of_text is not None else -1)
    bos = _token_id(config.get("bos_token_id"), eos)  # Qwen2's configs: <|endoftext|>
    out: JSONObject = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "attention_dropout": 0.0,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "hidden_act": "silu",
        "hidden_size": shape.hidden,
        "initializer_range": _number(config, "initializer_range", 0.02),
        "intermediate_size": shape.ff,
        "max_position_embeddings": ctx.max_positions,
        "max_window_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_hidden_layers": shape.layers,
        "num_key_value_heads": shape.heads,
        "rms_norm_eps": _number(config, "layer_norm_epsilon", 1e-6),
        "rope_scaling": None,
        "rope_theta": _number(config, "rotary_emb_base", 10000.0),
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "dtype": dtype,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": shape.vocab,
    }
    if ctx.factor is not None and ctx.rope_scaling is not None:
        scaling: JSONObject = {
            "type": ctx.rope_scaling,
            "rope_type": ctx.rope_scaling,
            "factor": ctx.factor,
        }
        if ctx.rope_scaling == "yarn":
            scaling["original_max_position_embeddings"] = ctx.seq_length
        out["rope_scaling"] = scaling
    if quantization is not None:
        out["quantization_config"] = quantization
    # transformers (5.19) warns on every load of a config.json that does not say which
    # release wrote it; the release installed here is the one that will read it first
    with contextlib.suppress(metadata.PackageNotFoundError):
        out["transformers_version"] = metadata.version("transformers")
    return out


def gptq_quantization(
    in_config: Optional[Mapping[str, JSON]], quantize_file: Optional[Mapping[str, JSON]]
) -> JSONObject:
    """quantization_config for the GPTQ loaders: config.json's, else quantize_config.json's,
    with quant_method "gptq" and the v1 zero-point format Qwen's checkpoints use made
    explicit (checkpoint_format "gptq" unless the source says otherwise)."""
    base = in_config if in_config is not None else (quantize_file or {})
    out: JSONObject = dict(base)
    out["quant_method"] = "gptq"
    if "checkpoint_format" not in out:
        out["checkpoint_format"] = str(out.get("format", "gptq"))
    return out
