"""Converted folders for the proof's tests: `converted` runs convert (without its own
proof, which the tests call themselves); `corrupt` changes OUT's weights the ways the
proof must catch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from qwen_kvprep.convert.run import ConvertOptions, convert


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
        return out / json.loads(index.read_text())["weight_map"][name]
    return out / "model.safetensors"


def corrupt(out: Path, how: str) -> str:
    """Change OUT's weights: "weight" adds 1e-2 to one element of layer 0's down_proj,
    "swap-qk" exchanges layer 0's q_proj and k_proj. Returns the tensor name concerned."""
    from safetensors.torch import load_file, save_file

    name = (
        "model.layers.0.mlp.down_proj.weight" if how == "weight"
        else "model.layers.0.self_attn.q_proj.weight"
    )
    path = _file_of(out, name)
    tensors = load_file(str(path))
    if how == "weight":
        t = tensors[name].clone()
        t.view(-1)[7] += 1e-2
        tensors[name] = t
    elif how == "swap-qk":
        k = "model.layers.0.self_attn.k_proj.weight"
        assert _file_of(out, k) == path
        tensors[name], tensors[k] = tensors[k], tensors[name]
    else:
        raise ValueError(how)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return name
