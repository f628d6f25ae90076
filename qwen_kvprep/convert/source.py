"""What DIR holds, read as the plan needs it: the config, the weight files in reading order,
every tensor's header, and the mapping checked against the config. Reads headers only (and
a `.bin` file through an mmap where torch has one): nothing is written anywhere."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from qwen_kvprep.convert.gptq import GptqLayout, layout
from qwen_kvprep.convert.mapping import Plan, QwenDims, model_shape, plan
from qwen_kvprep.convert.pieces import TensorInfo
from qwen_kvprep.convert.weights import open_source
from qwen_kvprep.errors import CheckpointError
from qwen_kvprep.gptqconfig import IN_CONFIG, QUANTIZE_CONFIG, is_gptq, parse
from qwen_kvprep.jsontypes import JSON, JSONObject
from qwen_kvprep.probe.checkpoint import CheckpointFacts


@dataclass(frozen=True)
class SourcePlan:
    directory: Path
    config: Mapping[str, JSON]
    shape: QwenDims
    files: tuple[str, ...]  # weight files, in reading order
    file_of: Mapping[str, str]  # source tensor -> its file
    plan: Plan
    gptq: Optional[GptqLayout]
    quantization: Optional[JSONObject]  # the source's GPTQ config (config.json's first)
    quantize_file: Optional[JSONObject]  # quantize_config.json, when there is one
    stored_dtype: str  # the embedding's dtype


def _gptq(cp: CheckpointFacts) -> tuple[Optional[GptqLayout], Optional[JSONObject]]:
    config = cp.config or {}
    qc = config.get("quantization_config")
    where, data = IN_CONFIG, qc if isinstance(qc, dict) and is_gptq(qc) else None
    if data is None and cp.quantize_config is not None and cp.quantize_config.data is not None:
        where, data = QUANTIZE_CONFIG, cp.quantize_config.data
    if data is None:
        if qc is not None:
            raise CheckpointError(
                "config.json's quantization_config is not GPTQ's: convert maps unquantized "
                "and GPTQ checkpoints only"
            )
        return None, None
    cfg, problems = parse(data, where)
    if cfg is None:
        raise CheckpointError("; ".join(problems))
    return layout(cfg.bits, cfg.group_size), dict(data)


def read_source(cp: CheckpointFacts) -> SourcePlan:
    """The plan for the validated checkpoint `cp` (CheckpointError naming the tensor or file
    that does not fit)."""
    directory = cp.path
    if cp.config is None:
        raise CheckpointError(f"{directory}/config.json cannot be read")
    if not cp.weight_files:
        raise CheckpointError(f"{directory} holds no weights (model*.safetensors or *.bin)")
    gl, quantization = _gptq(cp)
    found: dict[str, TensorInfo] = {}
    file_of: dict[str, str] = {}
    for fname in cp.weight_files:
        with open_source(directory / fname) as src:
            for name, info in src.infos().items():
                if name in file_of:
                    raise CheckpointError(
                        f"{name} is in both {file_of[name]} and {fname}: which one the loaders "
                        "take is undefined",
                        fix="re-download the checkpoint's weights",
                    )
                found[name] = info
                file_of[name] = fname
    index = cp.index.weight_map if cp.index is not None else {}
    for name, fname in index.items():
        if file_of.get(name, fname) != fname:
            raise CheckpointError(
                f"{cp.index.name if cp.index else 'the index'} puts {name} in {fname}, but it "
                f"is in {file_of[name]}",
                fix="re-download the checkpoint's weights and their index",
            )
    mapped = plan(cp.config, found, gl)
    qfile = cp.quantize_config.data if cp.quantize_config is not None else None
    return SourcePlan(
        directory=directory,
        config=cp.config,
        shape=model_shape(cp.config),
        files=tuple(cp.weight_files),
        file_of=file_of,
        plan=mapped,
        gptq=gl,
        quantization=quantization,
        quantize_file=dict(qfile) if qfile is not None else None,
        stored_dtype=found["transformer.wte.weight"].dtype,
    )
