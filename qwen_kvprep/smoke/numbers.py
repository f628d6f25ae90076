"""In the smoke child: does the loaded model hold the checkpoint's own numbers?

transformers 5 builds a model on the meta device and fills what the checkpoint did not
hold afterwards; with Qwen (v1)'s code as shipped, that silently re-initializes loaded
weights and leaves the rotary and log-n buffers as uninitialized memory. Two checks, both
bounded in time whatever the model's size:

- stored against loaded: every tensor the checkpoint's safetensors files hold, read in
  slices of at most SLICE_BYTES from each end (a re-initialized tensor differs
  everywhere, and a 72B checkpoint is not read again whole), equals the loaded parameter
  or buffer of that name, cast as the load casts it. GPTQ-packed tensors are left out:
  backends repack them on load.
- computed buffers: the non-persistent buffers of the attention layers and the rotary
  embedding equal those of a fresh instance of the model's own class, built from a
  one-head copy of the config outside from_pretrained (so the model's own `__init__`
  computes them).
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from qwen_kvprep.smoke.protocol import LoadedNumbers
from qwen_kvprep.untrusted import read_record

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

SLICE_BYTES = 64 << 10  # from each end of a tensor
INDEX_LIMIT = 16 << 20  # a 72B checkpoint's index is about 100 KB
INDEX = "model.safetensors.index.json"
GPTQ_PARTS = ("qweight", "qzeros", "scales", "g_idx")
SHOWN = 5  # names listed in the result


def _shards(directory: Path) -> list[Path]:
    """The safetensors files of the folder: those its index names (plain file names in
    the folder only: the index is the user's file, read bounded), else every one."""
    index = directory / INDEX
    if index.is_file():
        data = read_record(index, INDEX_LIMIT)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        names = {str(f) for f in weight_map.values()} if isinstance(weight_map, dict) else set()
        plain = [n for n in names if n == Path(n).name and n not in ("", ".", "..")]
        return sorted(directory / n for n in plain)
    return sorted(directory.glob("*.safetensors"))


def _ends(sliced: object, rows: int, row_bytes: int) -> list[tuple[slice, torch.Tensor]]:
    """Up to SLICE_BYTES of rows from each end of a tensor, by safetensors' lazy slice."""
    take = max(1, SLICE_BYTES // max(1, row_bytes))
    if rows <= 2 * take:
        return [(slice(0, rows), sliced[0:rows])]  # type: ignore[index]
    return [
        (slice(0, take), sliced[0:take]),  # type: ignore[index]
        (slice(rows - take, rows), sliced[rows - take : rows]),  # type: ignore[index]
    ]


def stored_against_loaded(model: PreTrainedModel, directory: Path) -> tuple[int, int, list[str]]:
    """(tensors compared, tensors stored, names whose loaded values differ)."""
    import torch
    from safetensors import safe_open

    loaded = dict(model.state_dict(keep_vars=True))
    compared, total, differ = 0, 0, []
    for shard in _shards(directory):
        with safe_open(str(shard), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 (safe_open is not a mapping)
                total += 1
                if name.rsplit(".", 1)[-1] in GPTQ_PARTS:
                    continue
                target = loaded.get(name)
                if target is None:
                    differ.append(f"{name} (not in the loaded model)")
                    continue
                sliced = fh.get_slice(name)
                shape = sliced.get_shape()
                compared += 1
                if list(target.shape) != list(shape):
                    differ.append(f"{name} (shape {list(target.shape)}, stored {list(shape)})")
                    continue
                if not shape:
                    pieces = [(slice(None), fh.get_tensor(name))]
                    view = target.detach()
                else:
                    row_bytes = target.element_size() * max(1, target[0].numel())
                    pieces = _ends(sliced, shape[0], row_bytes)
                    view = target.detach()
                for rows, stored in pieces:
                    got = view if not shape else view[rows]
                    want = stored.to(device=got.device, dtype=got.dtype)
                    if not torch.equal(got, want):
                        differ.append(name)
                        break
    return compared, total, differ


def _one_head_config(config: object) -> object:
    small = copy.deepcopy(config)
    kv = int(getattr(small, "kv_channels", 128))
    for key, value in (
        ("num_attention_heads", 1),
        ("hidden_size", kv),
        ("intermediate_size", 2),
        ("num_hidden_layers", 1),
        ("use_cache_kernel", False),  # no extension load for a throw-away layer
    ):
        setattr(small, key, value)
    return small


def _reference(module: torch.nn.Module, config: object) -> Optional[torch.nn.Module]:
    """A fresh instance of the module's own class, built by the model's own code."""
    cls = type(module)
    if hasattr(module, "inv_freq") and hasattr(module, "dim") and hasattr(module, "base"):
        return cls(module.dim, base=module.base)
    if hasattr(module, "c_attn"):
        return cls(_one_head_config(config))
    return None


def computed_buffers(model: PreTrainedModel) -> tuple[int, list[str]]:
    """(buffers compared, names that differ from what the model's code computes)."""
    import torch

    compared, differ = 0, []
    references: dict[type, Optional[torch.nn.Module]] = {}
    for prefix, module in model.named_modules():
        if not list(module.buffers(recurse=False)) and not hasattr(module, "cache_qmax"):
            continue
        kind = type(module)
        if kind not in references or hasattr(module, "inv_freq"):
            try:
                with torch.device("cpu"):
                    references[kind] = _reference(module, model.config)
            except Exception:  # a revision whose constructor takes other arguments
                references[kind] = None
        ref = references[kind]
        if ref is None:
            continue
        want = dict(ref.named_buffers(recurse=False))
        for attr in ("cache_qmax", "cache_qmin"):
            value = getattr(ref, attr, None)
            if isinstance(value, torch.Tensor):
                want[attr] = value
        for name, expected in want.items():
            got = getattr(module, name, None)
            label = f"{prefix}.{name}" if prefix else name
            if not isinstance(got, torch.Tensor):
                continue
            compared += 1
            if got.is_meta or list(got.shape) != list(expected.shape):
                differ.append(label)
                continue
            if not torch.equal(got.detach(), expected.to(device=got.device, dtype=got.dtype)):
                differ.append(label)
    return compared, differ


def loaded_numbers(model: PreTrainedModel, directory: str) -> LoadedNumbers:
    t0 = time.perf_counter()
    compared, total, differ = stored_against_loaded(model, Path(directory))
    buffers, bad = computed_buffers(model)
    return {
        "tensors_compared": compared,
        "tensors_stored": total,
        "tensors_differ": len(differ),
        "tensors_differ_names": differ[:SHOWN],
        "buffers_compared": buffers,
        "buffers_differ": len(bad),
        "buffers_differ_names": bad[:SHOWN],
        "seconds": round(time.perf_counter() - t0, 3),
    }
