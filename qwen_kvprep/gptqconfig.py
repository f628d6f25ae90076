"""The GPTQ quantization config, read by one grammar for doctor, fix and plan.

Two files may carry it: config.json's `quantization_config` (with `quant_method: "gptq"`),
the only one transformers reads when it builds the quantized modules, and
quantize_config.json, AutoGPTQ's copy, which other GPTQ tools read. Each field is judged
here as those readers would use it: `bits` an integer (2, 3, 4 or 8: a string "4" or a
float 4.0 breaks the kernels' integer arithmetic), `group_size` -1 or positive, `desc_act`
and `sym` true or false (a string "false" would read as true), `damp_percent` between 0
and 1 (transformers refuses anything else at load), the checkpoint format one transformers
knows.

The packed tensors of each quantized linear (`P.qweight`, `P.qzeros`, `P.scales`,
`P.g_idx`) must fit the config, which their shapes in the safetensors headers show without
reading a weight: for `in` inputs and `out` outputs, `qweight` is int32 `[in * bits / 32,
out]`, `qzeros` `[groups, out * bits / 32]`, `scales` `[groups, out]` and `g_idx` `[in]`,
with `groups = ceil(in / group_size)` (one for group_size -1).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from qwen_kvprep.untrusted import TooLarge, describe_json_error, load_json, read_regular

if TYPE_CHECKING:
    from qwen_kvprep.jsontypes import JSON, JSONObject

QUANTIZE_CONFIG = "quantize_config.json"
IN_CONFIG = "config.json's quantization_config"
# Qwen's quantize_config.json is about 250 bytes; a file past this is no quantization config.
QUANTIZE_CONFIG_LIMIT = 1 << 20
_DEPTH = 16

BITS = (2, 3, 4, 8)
FORMATS = ("gptq", "gptq_v2")
PACKED = ("qweight", "qzeros", "scales", "g_idx")
# The fields the grammar reads: a duplicate that changes one of them changes the model.
FIELDS = (
    "quant_method", "bits", "group_size", "desc_act", "sym", "damp_percent",
    "checkpoint_format", "format",
)  # fmt: skip
# What two configs of one checkpoint must agree on.
COMPARED = ("bits", "group_size", "desc_act", "sym")


@dataclass(frozen=True)
class GptqConfig:
    """The fields that decide how the packed weights are read (defaults as transformers')."""

    bits: int
    group_size: int  # -1: one group spanning the whole input dimension
    desc_act: bool = False
    sym: bool = True

    def value(self, name: str) -> object:
        return {
            "bits": self.bits, "group_size": self.group_size, "desc_act": self.desc_act,
            "sym": self.sym,
        }[name]  # fmt: skip


@dataclass(frozen=True)
class Duplicate:
    """A key that appears twice in one object of the file (json keeps the last value)."""

    key: str
    first: JSON
    last: JSON

    @property
    def changes_a_field(self) -> bool:
        # compared as JSON text: in Python 1 == True, and a duplicate 1/true is a change
        return self.key in FIELDS and shown(self.first) != shown(self.last)


@dataclass(frozen=True)
class QuantizeFile:
    """quantize_config.json as read: its object, or why it could not be used."""

    data: Optional[JSONObject] = None
    duplicates: tuple[Duplicate, ...] = ()
    error: Optional[str] = None  # completes "quantize_config.json ..."
    kind: Optional[str] = None  # "too-large" | "invalid-json" | "unreadable"


def shown(value: JSON) -> str:
    """A value as it is written in the JSON file."""
    return json.dumps(value)


def is_gptq(qc: JSON) -> bool:
    """True for a quantization config whose quant_method is GPTQ's."""
    return isinstance(qc, Mapping) and str(qc.get("quant_method", "")).lower() == "gptq"


def read_quantize_config(path: os.PathLike[str]) -> QuantizeFile:
    """quantize_config.json, bounded: a regular file of at most QUANTIZE_CONFIG_LIMIT bytes,
    strict UTF-8 JSON; duplicate keys are recorded (the last value kept, as json and
    AutoGPTQ keep it). Never raises for what the file holds."""
    try:
        raw = read_regular(path, QUANTIZE_CONFIG_LIMIT)
    except TooLarge as exc:
        return QuantizeFile(
            error=f"is too large to be a quantization config ({exc.size:,} bytes, limit "
            f"{exc.limit:,})",
            kind="too-large",
        )
    except OSError as exc:
        return QuantizeFile(error=describe_json_error(exc), kind="unreadable")
    duplicates: list[Duplicate] = []

    def keep_last(pairs: list[tuple[str, JSON]]) -> JSON:
        out: JSONObject = {}
        for key, value in pairs:
            if key in out:
                duplicates.append(Duplicate(key, out[key], value))
            out[key] = value
        return out

    try:
        data = load_json(raw, _DEPTH, keep_last)
    except ValueError as exc:  # not UTF-8, not JSON, nested too deep
        return QuantizeFile(error=describe_json_error(exc), kind="invalid-json")
    if not isinstance(data, dict):
        return QuantizeFile(error="does not hold a JSON object", kind="invalid-json")
    return QuantizeFile(data=data, duplicates=tuple(duplicates))


def _integer(value: JSON) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _kind(value: JSON) -> str:
    """`'4' (a string)`: a value and what JSON type it is, for a message."""
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}
    what = "null" if value is None else names.get(type(value), "a list or an object")
    return f"{shown(value)} ({what})"


def parse(qc: Mapping[str, JSON], where: str) -> tuple[Optional[GptqConfig], tuple[str, ...]]:
    """(the config, ()) or (None, what is wrong): each problem a sentence that names
    `where` (IN_CONFIG or QUANTIZE_CONFIG), the field and its value."""
    problems: list[str] = []
    method = qc.get("quant_method")
    if where == IN_CONFIG and method is None:
        problems.append(
            f"{where} has no quant_method (transformers refuses it: `ValueError: ... has no "
            "`quant_method` attribute`)"
        )
    elif method is not None and str(method).lower() != "gptq":
        problems.append(f"{where} gives quant_method {_kind(method)}, not \"gptq\"")
    bits = qc.get("bits")
    if "bits" not in qc:
        problems.append(f"{where} has no bits (2, 3, 4 or 8)")
    elif not _integer(bits) or bits not in BITS:
        problems.append(f"{where} gives bits {_kind(bits)}: it must be the integer 2, 3, 4 or 8")
    group = qc.get("group_size", 128)
    if not _integer(group) or not (group == -1 or (isinstance(group, int) and group > 0)):
        problems.append(
            f"{where} gives group_size {_kind(group)}: it must be an integer, -1 or positive"
        )
    flags: dict[str, bool] = {}
    for name, default in (("desc_act", False), ("sym", True)):
        value = qc.get(name, default)
        if isinstance(value, bool):
            flags[name] = value
        else:
            problems.append(f"{where} gives {name} {_kind(value)}: it must be true or false")
    damp = qc.get("damp_percent", 0.1)
    if isinstance(damp, bool) or not isinstance(damp, (int, float)) or not 0 < damp < 1:
        problems.append(
            f"{where} gives damp_percent {_kind(damp)}: it must be a number between 0 and 1 "
            "(transformers refuses the config otherwise)"
        )
    for name in ("checkpoint_format", "format"):
        fmt = qc.get(name)
        if fmt is not None and (not isinstance(fmt, str) or fmt.lower() not in FORMATS):
            problems.append(f"{where} gives {name} {_kind(fmt)}, not one of {', '.join(FORMATS)}")
    if problems or not isinstance(bits, int) or not isinstance(group, int):
        return None, tuple(problems)
    return GptqConfig(bits, group, flags["desc_act"], flags["sym"]), ()


# -- the packed tensors ---------------------------------------------------------------------


def layers(shapes: Mapping[str, Sequence[int]]) -> list[str]:
    """The quantized linears (`transformer.h.0.attn.c_attn`...) that have a packed qweight."""
    return sorted(name[: -len(".qweight")] for name in shapes if name.endswith(".qweight"))


def _packed_width(n: int, bits: int, name: str, what: str) -> tuple[Optional[int], str]:
    """(n * bits / 32, "") when whole, else (None, why)."""
    if (n * bits) % 32:
        return None, f"{n} {what} at {bits} bits do not fill whole int32 words ({name})"
    return n * bits // 32, ""


def misfit(cfg: GptqConfig, prefix: str, shapes: Mapping[str, Sequence[int]]) -> Optional[str]:
    """Why the packed tensors of the linear `prefix` do not fit `cfg`; None when they do.
    Only shapes are read: what a header says."""
    got = {s: list(shapes[f"{prefix}.{s}"]) for s in PACKED if f"{prefix}.{s}" in shapes}
    qweight = got["qweight"]
    for suffix, shape in got.items():
        if len(shape) != (1 if suffix == "g_idx" else 2):
            return f"{prefix}.{suffix} has the shape {shape}, not a GPTQ {suffix}'s"
    rows, out = qweight
    bits = cfg.bits
    if "g_idx" in got:
        inputs = got["g_idx"][0]
        want, why = _packed_width(inputs, bits, prefix, "inputs")
        if want is None:
            return why
        if rows != want:
            packed = f"; {rows} rows are {rows * 32 // inputs} bits a weight" if (
                inputs and rows * 32 % inputs == 0
            ) else ""
            return (
                f"{prefix}.qweight is {qweight}: {inputs} inputs (its g_idx) at {bits} bits "
                f"pack into {want} rows, not {rows}{packed}"
            )
    elif rows * 32 % bits:
        return f"{prefix}.qweight is {qweight}: {rows} rows do not hold whole {bits}-bit weights"
    else:
        inputs = rows * 32 // bits
    groups = 1 if cfg.group_size == -1 else -(-inputs // cfg.group_size)
    if "scales" in got and got["scales"] != [groups, out]:
        size = "one group (group_size -1)" if cfg.group_size == -1 else (
            f"groups of {cfg.group_size}"
        )
        return (
            f"{prefix}.scales is {got['scales']}: {inputs} inputs in {size} and {out} outputs "
            f"make [{groups}, {out}]"
        )
    if "qzeros" in got:
        width, why = _packed_width(out, bits, prefix, "outputs")
        if width is None:
            return why
        if got["qzeros"] != [groups, width]:
            return (
                f"{prefix}.qzeros is {got['qzeros']}: {groups} group(s) of {out} zero points "
                f"at {bits} bits pack into [{groups}, {width}]"
            )
    return None


def packing_hint(prefix: str, shapes: Mapping[str, Sequence[int]]) -> Optional[tuple[int, int]]:
    """(bits, group_size) the tensors of `prefix` were packed with, where the shapes alone
    say so (a g_idx gives the inputs; one row of scales could be either -1 or a group
    as large as the inputs, so it says nothing)."""
    qweight, scales, g_idx = (shapes.get(f"{prefix}.{s}") for s in ("qweight", "scales", "g_idx"))
    if not (qweight and scales and g_idx) or len(qweight) != 2 or len(scales) != 2:
        return None
    inputs, rows, groups = g_idx[0], qweight[0], scales[0]
    if not inputs or (rows * 32) % inputs or groups < 2 or inputs % groups:
        return None
    bits = rows * 32 // inputs
    return (bits, inputs // groups) if bits in BITS else None
