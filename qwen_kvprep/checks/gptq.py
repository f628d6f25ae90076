"""checkpoint.gptq: a GPTQ checkpoint's quantization config is valid, its two copies agree,
and it fits the packed weights (their shapes in the safetensors headers).

transformers builds the quantized modules from config.json's quantization_config alone:
without it the packed tensors (`*.qweight`...) match no parameter, and every block linear
is loaded as newly initialized, random weights. The model then generates noise while
loading and the kernel work fine, so nothing later would notice.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence

from qwen_kvprep.checks.checkpoint import CheckResult, redownload
from qwen_kvprep.checks.registry import CHECKPOINT, LISTED, QWEN_V1, check, checkpoint_of
from qwen_kvprep.checks.verdicts import fail, info, ok, skip, warn
from qwen_kvprep.common import gptq_install
from qwen_kvprep.configjson import CONFIG
from qwen_kvprep.findings import Finding
from qwen_kvprep.gptqconfig import (
    COMPARED,
    IN_CONFIG,
    QUANTIZE_CONFIG,
    GptqConfig,
    is_gptq,
    layers,
    misfit,
    packing_hint,
    parse,
    shown,
)
from qwen_kvprep.jsontypes import JSON
from qwen_kvprep.probe.checkpoint import CheckpointFacts
from qwen_kvprep.probe.facts import Facts

_RANDOM = (
    "transformers would load every block linear as newly initialized (random) weights "
    "(`Some weights of QWenLMHeadModel were not initialized from the model checkpoint ... "
    "newly initialized`), and the model would generate noise"
)
_FILE = {IN_CONFIG: CONFIG, QUANTIZE_CONFIG: QUANTIZE_CONFIG}


def _hint(shapes: Mapping[str, Sequence[int]], linears: Sequence[str]) -> str:
    found = packing_hint(linears[0], shapes) if linears else None
    if found is None:
        return ""
    bits, group = found
    return f" (the weights are packed at bits {bits}, group_size {group})"


def _duplicates(cp: CheckpointFacts) -> list[Finding]:
    qfile = cp.quantize_config
    out: list[Finding] = []
    for dup in qfile.duplicates if qfile is not None else ():
        what = (
            f"{QUANTIZE_CONFIG} gives {dup.key} twice, {shown(dup.first)} and then "
            f"{shown(dup.last)}: readers keep the last one silently"
        )
        fix = (
            f"keep one {dup.key!r} in {shlex.quote(str(cp.path / QUANTIZE_CONFIG))}, or "
            f"re-download it: {redownload(cp, [QUANTIZE_CONFIG])}"
        )
        make = fail if dup.changes_a_field else warn
        out.append(make(what, fix, paths=[cp.path / QUANTIZE_CONFIG], key=dup.key))
    return out


def _no_config(cp: CheckpointFacts, linears: Sequence[str], hint: str) -> Finding:
    """Packed weights, and nothing in config.json that makes transformers unpack them."""
    qdata = cp.quantize_config.data if cp.quantize_config is not None else None
    shards = sorted(s.name for s in cp.shards if s.gptq_shapes)
    held = f"{', '.join(shards)} hold{'s' if len(shards) == 1 else ''}"
    if qdata is not None and parse(qdata, QUANTIZE_CONFIG)[0] is not None:
        besides = f" ({QUANTIZE_CONFIG} has one, but transformers never reads that file)"
        entry = json.dumps({**qdata, "quant_method": "gptq"})
        fix = (
            f"re-download {CONFIG}: {redownload(cp, [CONFIG])}; or add to "
            f"{shlex.quote(str(cp.path / CONFIG))} the entry `\"quantization_config\": {entry}`"
        )
    else:
        besides = f" and there is no {QUANTIZE_CONFIG}" if cp.quantize_config is None else ""
        fix = f"re-download both: {redownload(cp, [CONFIG, QUANTIZE_CONFIG])}"
    return fail(
        f"{held} GPTQ-packed weights ({len(linears)} quantized linears, e.g. "
        f"{linears[0]}.qweight) but {CONFIG} has no quantization_config{besides}: {_RANDOM}"
        f"{hint}",
        fix, paths=[cp.path / CONFIG], linears=len(linears),
    )


def _parsed(
    cp: CheckpointFacts, sources: Mapping[str, Mapping[str, JSON]], hint: str
) -> tuple[dict[str, GptqConfig], list[Finding]]:
    configs: dict[str, GptqConfig] = {}
    out: list[Finding] = []
    for where, data in sources.items():
        parsed, problems = parse(data, where)
        if parsed is not None:
            configs[where] = parsed
            continue
        name = _FILE[where]
        out.append(fail(
            "; ".join(problems) + f"{hint}: GPTQ loaders cannot read the packed weights with it",
            f"correct it in {shlex.quote(str(cp.path / name))}, or re-download it: "
            f"{redownload(cp, [name])}",
            paths=[cp.path / name], problems=list(problems),
        ))
    return configs, out


def _disagree(cp: CheckpointFacts, configs: Mapping[str, GptqConfig], hint: str) -> list[Finding]:
    if len(configs) < 2:
        return []
    ours, theirs = configs[IN_CONFIG], configs[QUANTIZE_CONFIG]
    differ = [f for f in COMPARED if ours.value(f) != theirs.value(f)]
    if not differ:
        return []
    said = "; ".join(
        f"{IN_CONFIG} says {f} {json.dumps(ours.value(f))}, {QUANTIZE_CONFIG} says {f} "
        f"{json.dumps(theirs.value(f))}"
        for f in differ
    )
    return [fail(
        f"the two GPTQ configs disagree: {said}{hint}; transformers reads the first, other "
        "GPTQ tools the second, so one of them misreads the weights",
        f"make both say what the weights were packed with, or re-download both: "
        f"{redownload(cp, [CONFIG, QUANTIZE_CONFIG])}",
        paths=[cp.path / CONFIG, cp.path / QUANTIZE_CONFIG], fields=differ,
    )]


def _misfits(
    cp: CheckpointFacts, configs: Mapping[str, GptqConfig],
    shapes: Mapping[str, Sequence[int]], linears: Sequence[str], hint: str,
) -> list[Finding]:
    out: list[Finding] = []
    for where, cfg in configs.items():
        bad = [why for why in (misfit(cfg, p, shapes) for p in linears) if why is not None]
        if not bad:
            continue
        name = _FILE[where]
        out.append(fail(
            f"{where} (bits {cfg.bits}, group_size {cfg.group_size}) does not fit the packed "
            f"weights of {len(bad)} of {len(linears)} quantized linears: {bad[0]}{hint}",
            f"set bits and group_size in {shlex.quote(str(cp.path / name))} to what the weights "
            f"were packed with, or re-download the checkpoint's configs: "
            f"{redownload(cp, [CONFIG, QUANTIZE_CONFIG])}",
            paths=[cp.path / name], linears=len(bad),
        ))
    return out


def _unpacked(cp: CheckpointFacts) -> bool:
    """Every safetensors shard was judged whole from its header and none holds a qweight."""
    index = cp.index
    return (
        cp.weights_layout.startswith("safetensors")
        and bool(cp.shards)
        and all(s.error is None for s in cp.shards)
        and (index is None or not (index.missing or index.refused or index.error))
        and len(cp.shards) == len(cp.weight_files)
    )


@check(
    "checkpoint.gptq",
    "GPTQ checkpoints: a valid quantization config that fits the packed weights",
    needs=(CHECKPOINT, LISTED, QWEN_V1),
)
def gptq(facts: Facts) -> CheckResult:
    cp = checkpoint_of(facts)
    shapes = {k: v for s in cp.shards for k, v in s.gptq_shapes.items()}
    linears = layers(shapes)
    if not linears and not cp.gptq:
        return ok("not a GPTQ checkpoint")
    hint = _hint(shapes, linears)
    qc = cp.config.get("quantization_config") if cp.config is not None else None
    sources: dict[str, Mapping[str, JSON]] = {}
    if isinstance(qc, dict) and is_gptq(qc):
        sources[IN_CONFIG] = qc
    qdata = cp.quantize_config.data if cp.quantize_config is not None else None
    if qdata is not None:
        sources[QUANTIZE_CONFIG] = qdata
    out = _duplicates(cp)
    if linears and cp.config is not None and qc is None:
        out.append(_no_config(cp, linears, hint))
    elif IN_CONFIG in sources and not linears and _unpacked(cp):
        out.append(fail(
            f"{IN_CONFIG} says GPTQ, but no safetensors shard holds a packed qweight: "
            "transformers would build quantized linears that nothing in the checkpoint fills, "
            "and the model would generate noise",
            f"re-download the checkpoint: {redownload(cp)}", paths=[cp.path / CONFIG],
        ))
    configs, problems = _parsed(cp, sources, hint)
    out += problems + _disagree(cp, configs, hint) + _misfits(cp, configs, shapes, linears, hint)
    if out:
        return out
    if not sources:  # packed weights, and a config.json that could not be read
        return skip(f"{CONFIG} could not be read (see config.parse)")
    cfg = configs.get(IN_CONFIG) or configs.get(QUANTIZE_CONFIG)
    settings = f", bits {cfg.bits}, group_size {cfg.group_size}" if cfg is not None else ""
    fitted = f"; its {len(linears)} packed linears fit it" if linears else ""
    return info(
        f"GPTQ Int4 checkpoint (from {cp.gptq_source}{settings}{fitted}): loading it needs a "
        "GPTQ backend (optimum and gptqmodel, see env.gptq) besides torch and transformers; "
        "the Int8 KV cache works with it",
        gptq_install(), source=cp.gptq_source,
    )

