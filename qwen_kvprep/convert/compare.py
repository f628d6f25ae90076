"""The streamed bit-for-bit proof: every tensor of OUT equals its slice of DIR's tensor.

OUT's tensor set must be exactly the plan's targets, and each target's dtype, shape and
bytes those of its piece of the source (compared as raw bytes, so a NaN equals itself and
-0.0 differs from 0.0). Source files are read one at a time, each source tensor once; OUT's
shards are memory-mapped by `safe_open`. Nothing is written.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from qwen_kvprep.convert.pieces import TensorInfo
from qwen_kvprep.convert.source import SourcePlan
from qwen_kvprep.convert.weights import (
    ST_INDEX,
    ST_SINGLE,
    ST_TO_TORCH,
    OutShard,
    WrittenFile,
    cut,
    nbytes,
    open_source,
)
from qwen_kvprep.untrusted import describe_json_error, read_record, relpath_problem

if TYPE_CHECKING:
    import torch

_INDEX_LIMIT = 64 << 20


@dataclass
class TensorProof:
    tensors: int = 0  # compared and equal
    bytes: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, object]:
        return {"ok": self.ok, "tensors": self.tensors, "bytes": self.bytes,
                "problems": list(self.problems)}


def out_weight_map(out: Path) -> dict[str, str]:
    """OUT's tensor -> file (its index, or the one model.safetensors); ValueError if unsound."""
    if (out / ST_INDEX).exists():
        try:
            data = read_record(out / ST_INDEX, _INDEX_LIMIT, 8)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{ST_INDEX} {describe_json_error(exc)}") from exc
        wm = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(wm, dict):
            raise ValueError(f"{ST_INDEX} has no weight_map")
        out_map: dict[str, str] = {}
        for k, v in wm.items():
            if not isinstance(v, str) or relpath_problem(v) or "/" in v:
                raise ValueError(f"{ST_INDEX} maps {k} to {v!r}, not a file name in OUT")
            out_map[k] = v
        return out_map
    from safetensors import safe_open

    with safe_open(str(out / ST_SINGLE), framework="pt") as fh:
        names: list[str] = fh.keys()  # a method of safe_open, not a dict's
        return dict.fromkeys(names, ST_SINGLE)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    flat_a = a.contiguous().reshape(-1).view(torch.uint8)
    flat_b = b.contiguous().reshape(-1).view(torch.uint8)
    return bool(torch.equal(flat_a, flat_b))


def compare(
    sp: SourcePlan, out: Path, progress: Optional[Callable[[str], None]] = None
) -> TensorProof:
    """Compare OUT (or the staging folder) with DIR, tensor by tensor."""
    from safetensors import safe_open

    result = TensorProof()
    try:
        where = out_weight_map(out)
    except (OSError, ValueError) as exc:
        result.problems.append(f"OUT's weights cannot be listed: {exc}")
        return result
    targets = {p.target for p in sp.plan.pieces}
    for name in sorted(set(where) - targets):
        result.problems.append(f"{name} is in OUT but is no tensor of the mapping")
    for name in sorted(targets - set(where)):
        result.problems.append(f"{name} is missing from OUT")
    if result.problems:
        return result
    # an OUT shard stays mapped only until its last tensor is compared: each mapping keeps
    # the pages it touched resident, and all of OUT would otherwise be by the end
    left = Counter(where[p.target] for p in sp.plan.pieces)
    with ExitStack() as stack:
        handles: dict[str, tuple[ExitStack, object]] = {}

        def out_tensor(name: str) -> torch.Tensor:
            fname = where[name]
            if fname not in handles:
                own = stack.enter_context(ExitStack())
                handles[fname] = own, own.enter_context(
                    safe_open(str(out / fname), framework="pt")
                )
            got: torch.Tensor = handles[fname][1].get_tensor(name)  # type: ignore[attr-defined]
            return got

        def done_with(name: str) -> None:
            fname = where[name]
            left[fname] -= 1
            if left[fname] == 0 and fname in handles:
                handles.pop(fname)[0].close()

        by_source = sp.plan.by_source()
        for fname in sp.files:
            if progress is not None:
                progress(f"comparing with {fname}")
            with open_source(sp.directory / fname) as src:
                for source_name in src.infos():
                    pieces = by_source.get(source_name, [])
                    if not pieces:
                        continue
                    tensor = src.get(source_name)
                    for piece in pieces:
                        try:
                            mine = out_tensor(piece.target)
                        except Exception as exc:  # SafetensorError: not an OSError
                            result.problems.append(f"{piece.target} cannot be read: {exc}")
                            continue
                        finally:
                            done_with(piece.target)
                        if _same(cut(tensor, piece), mine):
                            result.tensors += 1
                            result.bytes += mine.numel() * mine.element_size()
                        else:
                            result.problems.append(
                                f"{piece.target} differs from {piece.source}"
                                + (f"[{piece.start}:{piece.stop}] along dim {piece.dim}"
                                   if piece.dim is not None else "")
                            )
                    del tensor
    return result


def check_written(
    out: Path,
    shards: Sequence[OutShard],
    written: Sequence[WrittenFile],
    progress: Optional[Callable[[str], None]] = None,
) -> TensorProof:
    """The bit-for-bit proof without reading DIR or OUT again: OUT's tensor names are the
    plan's; each shard was read back as it was written and held the bytes meant to be
    there (`written`, from convert/readback.py: each tensor's the cut of its source tensor
    as it was read, hashed on the way); and the header safetensors parses from it gives
    every planned tensor its planned dtype and shape."""
    result = TensorProof()
    try:
        where = out_weight_map(out)
    except (OSError, ValueError) as exc:
        result.problems.append(f"OUT's weights cannot be listed: {exc}")
        return result
    planned = {p.target: s.name for s in shards for p in s.pieces}
    for name in sorted(set(where) - set(planned)):
        result.problems.append(f"{name} is in OUT but is no tensor of the mapping")
    for name in sorted(set(planned) - set(where)):
        result.problems.append(f"{name} is missing from OUT")
    by_name = {w.name: w for w in written}
    for number, shard in enumerate(shards, 1):
        got = by_name.get(shard.name)
        problems = (list(got.problems) or _header_problems(out / shard.name, shard)
                    if got is not None else [f"{shard.name} was not read back"])
        result.problems += problems
        if not problems:
            result.tensors += len(shard.pieces)
            result.bytes += sum(nbytes(i) for i in shard.infos)
        if progress is not None:
            progress(f"checked {number}/{len(shards)} {shard.name}")
    return result


def _header_problems(path: Path, shard: OutShard) -> list[str]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as fh:
            names: list[str] = fh.keys()
            got = {}
            for n in names:
                sl = fh.get_slice(n)
                got[n] = TensorInfo(ST_TO_TORCH.get(sl.get_dtype(), sl.get_dtype()),
                                    tuple(sl.get_shape()))
    except Exception as exc:  # SafetensorError is not an OSError
        return [f"{shard.name} cannot be read: {exc}"]
    want = {p.target: i for p, i in zip(shard.pieces, shard.infos)}
    if got != want:
        wrong = sorted(n for n in set(got) | set(want) if got.get(n) != want.get(n))
        return [f"{shard.name}: {n} is {got.get(n)}, planned {want.get(n)}" for n in wrong]
    return []
