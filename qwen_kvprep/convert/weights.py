"""Streamed weights: source files read one at a time, output shards written tensor by tensor.

Reading: a safetensors file through `safe_open` (its header gives every name, dtype and
shape without touching a weight; `get_tensor` reads one); a `pytorch_model*.bin` through
`torch.load(weights_only=True)`, memory-mapped where torch has `mmap` (2.1 and later), else
the one file in memory.

Writing: each output shard is a safetensors file written by this module, header first: the
plan gives every output tensor's dtype and shape before a byte is read, so the header (and
every tensor's offset) is known up front and each tensor is written as soon as it is cut
from its source, then dropped. Resident memory is one source tensor and its slice, plus the
page cache's own pages of what the mmaps touched, whatever the model's size. Each shard
is read back as it is written (convert/readback.py), which gives its sha256.

The format written is safetensors' own (8-byte little-endian header length, the JSON
header with `data_offsets`, padded with spaces to 8 bytes, then the tensors' bytes in
header order), read back by `safe_open` in the bit-for-bit proof (convert/compare.py).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import struct
import sys
import time
from collections.abc import Generator, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from io import BufferedWriter
from pathlib import Path
from typing import IO, TYPE_CHECKING, Callable, Optional, Protocol, Union

from qwen_kvprep.convert.pieces import Piece, TensorInfo
from qwen_kvprep.convert.readback import ReadBack
from qwen_kvprep.convert.reads import Identity, Read, hash_file, read_of
from qwen_kvprep.errors import CheckpointError

if TYPE_CHECKING:
    from concurrent.futures import Future

    import torch

ST_INDEX = "model.safetensors.index.json"
ST_SINGLE = "model.safetensors"
_CHUNK = 1 << 20

# safetensors' dtype names and torch's (the suffix of torch.<name>)
ST_TO_TORCH: Mapping[str, str] = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "I32": "int32",
    "I64": "int64", "F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64",
}  # fmt: skip
TORCH_TO_ST = {v: k for k, v in ST_TO_TORCH.items()}
ITEMSIZE: Mapping[str, int] = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8,
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
}  # fmt: skip


class WeightFile(Protocol):
    """One weight file of DIR, open for reading."""

    def infos(self) -> dict[str, TensorInfo]: ...

    def get(self, name: str) -> torch.Tensor: ...


class _Safetensors:
    def __init__(self, handle: object) -> None:
        self._h = handle

    def infos(self) -> dict[str, TensorInfo]:
        out: dict[str, TensorInfo] = {}
        names: list[str] = self._h.keys()  # type: ignore[attr-defined]
        for name in names:
            sl = self._h.get_slice(name)  # type: ignore[attr-defined]
            dtype = sl.get_dtype()
            out[name] = TensorInfo(ST_TO_TORCH.get(dtype, dtype), tuple(sl.get_shape()))
        return out

    def get(self, name: str) -> torch.Tensor:
        tensor: torch.Tensor = self._h.get_tensor(name)  # type: ignore[attr-defined]
        return tensor


class _Pickle:
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self._t = tensors

    def infos(self) -> dict[str, TensorInfo]:
        return {
            n: TensorInfo(str(t.dtype).replace("torch.", ""), tuple(t.shape))
            for n, t in self._t.items()
        }

    def get(self, name: str) -> torch.Tensor:
        return self._t[name]


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    import torch

    params = inspect.signature(torch.load).parameters
    kwargs: dict[str, object] = {"map_location": "cpu"}
    if "weights_only" in params:
        kwargs["weights_only"] = True  # never run the pickle's code: DIR is not ours
    if "mmap" in params:
        kwargs["mmap"] = True
    try:
        try:
            data = torch.load(str(path), **kwargs)  # type: ignore[arg-type]
        except RuntimeError as exc:
            if not kwargs.pop("mmap", False) or "mmap" not in str(exc):
                raise
            # a file in torch's pre-1.6 format cannot be mapped: read it whole (one file)
            data = torch.load(str(path), **kwargs)  # type: ignore[arg-type]
    except Exception as exc:  # torch raises RuntimeError, UnpicklingError, EOFError...
        raise CheckpointError(
            f"{path.name} cannot be read as a PyTorch weights file: {exc}".split("\n")[0],
            fix="re-download it",
        ) from exc
    if not isinstance(data, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in data.items()
    ):
        raise CheckpointError(f"{path.name} is not a dictionary of named tensors")
    return data


@contextmanager
def open_source(path: Path) -> Iterator[WeightFile]:
    """The weight file at `path`, open for the `with` block (CheckpointError if unreadable)."""
    if path.name.endswith(".bin"):
        tensors = _load_bin(path)
        try:
            yield _Pickle(tensors)
        finally:
            del tensors
        return
    from safetensors import safe_open

    try:
        handle = safe_open(str(path), framework="pt")
    except Exception as exc:  # SafetensorError is not an OSError subclass
        raise CheckpointError(
            f"{path.name} cannot be read as a safetensors file: {exc}", fix="re-download it"
        ) from exc
    with handle:
        yield _Safetensors(handle)


class BackgroundHash:
    """A sha256 fed from the caller's thread and computed on another (hashlib lets go of
    the interpreter lock for large buffers), so that hashing a shard overlaps reading and
    writing the next tensor. Each buffer must stay unchanged until the next `update`."""

    def __init__(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._digest = hashlib.sha256()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvprep-sha256")
        self._pending: Optional[Future[None]] = None

    def update(self, data: object) -> None:
        self._wait()
        self._pending = self._pool.submit(self._digest.update, data)  # type: ignore[arg-type]

    def _wait(self) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def hexdigest(self) -> str:
        self._wait()
        self._pool.shutdown()
        return self._digest.hexdigest()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


_HEADER_LIMIT = 100 << 20  # safetensors' own limit on a header


def safetensors_layout(path: Path) -> dict[str, tuple[str, tuple[int, ...], int, int]]:
    """name -> (torch dtype name, shape, start, end) from the file's header, the offsets
    absolute in the file (CheckpointError if the header is unsound)."""
    with open(path, "rb") as fh:
        return _layout(fh, path)


def _layout(fh: IO[bytes], path: Path) -> dict[str, tuple[str, tuple[int, ...], int, int]]:
    head = fh.read(8)
    size = os.fstat(fh.fileno()).st_size
    if len(head) != 8:
        raise CheckpointError(f"{path.name} is too short for a safetensors file")
    (n,) = struct.unpack("<Q", head)
    if n > min(_HEADER_LIMIT, size - 8):
        raise CheckpointError(f"{path.name}: its safetensors header claims {n} bytes")
    raw = fh.read(n)
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise CheckpointError(f"{path.name}: its safetensors header is not JSON: {exc}") from exc
    out: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
    base = 8 + n
    if not isinstance(header, dict):
        raise CheckpointError(f"{path.name}: its safetensors header is not an object")
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = ST_TO_TORCH[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            start, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path.name}: header entry {name!r} is unsound") from exc
        if not 0 <= start <= end <= size - base or end - start != nbytes(
                TensorInfo(dtype, shape)):
            raise CheckpointError(f"{path.name}: {name} lies outside the file or is cut short")
        out[name] = (dtype, shape, base + start, base + end)
    return out


class Buffers:
    """Two buffers, taken in turn, for the tensors read (one larger than `largest` gets a
    buffer of its own). Fresh memory costs the kernel a page fault and a page of zeros
    every 4 KiB: reading a 2 GB shard into new buffers took 1.5 s of system time here,
    into reused ones 0.3 s. A buffer is taken again only once nothing reads it any more:
    the source's hash has moved on to a later buffer (BackgroundHash hashes one at a time,
    in order) and `wait(position)` says that every byte written from it was compared
    (ReadBack.wait_compared with the `told()` of when its tensor was done with)."""

    def __init__(self, told: Callable[[], int], wait: Callable[[int], None],
                 largest: int = 512 << 20) -> None:
        self._told, self._wait, self._largest = told, wait, largest
        self._buffers = [bytearray(), bytearray()]
        self._done_at = [0, 0]  # told() when each buffer's tensor was done with
        self._turn = 0

    def take(self, n: int) -> Union[bytearray, memoryview]:
        """A buffer of `n` bytes, once the one taken two turns ago is free."""
        if n > self._largest:
            return bytearray(n)
        turn = self._turn
        self._turn ^= 1
        self._wait(self._done_at[turn])
        if len(self._buffers[turn]) < n:
            self._buffers[turn] = bytearray(n)
        return memoryview(self._buffers[turn])[:n]

    def done(self) -> None:
        """The tensor of the buffer taken last is done with: all of it was written."""
        self._done_at[self._turn ^ 1] = self._told()


def stream_safetensors(
    path: Path, wanted: set[str], digest: BackgroundHash,
    buffers: Optional[Buffers] = None, seen: Optional[list[os.stat_result]] = None,
) -> Generator[tuple[str, torch.Tensor], None, None]:
    """The `wanted` tensors of a safetensors file in the order they lie in it, the file
    read once from start to end, every byte (header, gaps, tensors) into `digest`. A
    tensor's memory is one of `buffers` where given (the caller says `buffers.done()`
    before it asks for the next), else its own. `seen` is given the descriptor's stat as
    the read begins and as it ends."""
    import torch

    with open(path, "rb") as fh:
        if seen is not None:
            seen.append(os.fstat(fh.fileno()))
        layout = _layout(fh, path)
        base = fh.tell()
        fh.seek(0)
        head = fh.read(base)
        digest.update(head)
        pos = len(head)
        for name, (dtype, shape, start, end) in sorted(layout.items(), key=lambda kv: kv[1][2]):
            if start < pos:
                raise CheckpointError(f"{path.name}: {name} overlaps another tensor")
            if start > pos:
                digest.update(fh.read(start - pos))
            buf = bytearray(end - start) if buffers is None else buffers.take(end - start)
            if fh.readinto(buf) != len(buf):
                raise CheckpointError(f"{path.name} changed while it was read (it is shorter)",
                                      fix="run convert again once nothing writes DIR")
            digest.update(buf)
            pos = end
            if name in wanted:
                kind = getattr(torch, dtype)
                tensor = (torch.frombuffer(buf, dtype=torch.uint8).view(kind).reshape(shape)
                          if len(buf) else torch.empty(shape, dtype=kind))
                yield name, tensor
            elif buffers is not None:
                buffers.done()  # hashed only
        for chunk in iter(lambda: fh.read(_CHUNK), b""):
            digest.update(chunk)
        if seen is not None:
            seen.append(os.fstat(fh.fileno()))


def by_offset(
    directory: Path, files: Sequence[str], groups: Sequence[Sequence[Piece]]
) -> list[list[Piece]]:
    """Each safetensors file's pieces in the order their tensors lie in the file (it is
    then read once, front to back); a .bin file's as they are."""
    out: list[list[Piece]] = []
    for fname, group in zip(files, groups):
        if fname.endswith(".bin"):
            out.append(list(group))
            continue
        layout = safetensors_layout(directory / fname)
        first = {p.source: layout.get(p.source, ("", (), 0, 0))[2] for p in group}
        out.append(sorted(group, key=lambda p: first[p.source]))  # stable: a source's
        # pieces keep their order
    return out


def sha256_stream(path: Path) -> str:
    """The file's sha256, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


# ------------------------------------------------------------------ planning the output


def piece_info(piece: Piece, source: TensorInfo) -> TensorInfo:
    shape = list(source.shape)
    if piece.dim is not None:
        shape[piece.dim] = piece.stop - piece.start
    return TensorInfo(source.dtype, tuple(shape))


def nbytes(info: TensorInfo) -> int:
    n = ITEMSIZE[info.dtype]
    for d in info.shape:
        n *= d
    return n


@dataclass(frozen=True)
class OutShard:
    name: str
    pieces: tuple[Piece, ...]
    infos: tuple[TensorInfo, ...]

    @property
    def size(self) -> int:
        return sum(nbytes(i) for i in self.infos)


def shard_names(n: int) -> list[str]:
    if n == 1:
        return [ST_SINGLE]
    return [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def plan_shards(
    groups: Sequence[Sequence[Piece]],
    sources: Mapping[str, TensorInfo],
    max_bytes: Optional[int],
) -> list[OutShard]:
    """Output shards, in order. `groups`: the pieces of each source file, in reading order.
    Without `max_bytes` one output shard per source file (the source's own sharding);
    with it, consecutive shards of at most that many bytes (a larger tensor alone)."""
    runs: list[list[Piece]] = []
    if max_bytes is None:
        runs = [list(g) for g in groups if g]
    else:
        size = 0
        for group in groups:
            for piece in group:
                n = nbytes(piece_info(piece, sources[piece.source]))
                if not runs or (runs[-1] and size + n > max_bytes):
                    runs.append([])
                    size = 0
                runs[-1].append(piece)
                size += n
    names = shard_names(len(runs))
    return [
        OutShard(name, tuple(run), tuple(piece_info(p, sources[p.source]) for p in run))
        for name, run in zip(names, runs)
    ]


def index_json(shards: Sequence[OutShard]) -> bytes:
    weight_map = {p.target: s.name for s in shards for p in s.pieces}
    data = {
        "metadata": {"total_size": sum(s.size for s in shards)},
        "weight_map": dict(sorted(weight_map.items())),
    }
    return (json.dumps(data, indent=2) + "\n").encode()


# ------------------------------------------------------------------ writing


def _header(shard: OutShard) -> bytes:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for piece, info in zip(shard.pieces, shard.infos):
        n = nbytes(info)
        header[piece.target] = {
            "dtype": TORCH_TO_ST[info.dtype],
            "shape": list(info.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(len(raw) + 8) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def cut(tensor: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The piece's slice of its source tensor, as a contiguous tensor of its own."""
    if piece.dim is not None:
        tensor = tensor.narrow(piece.dim, piece.start, piece.stop - piece.start)
    return tensor.contiguous()


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    import torch

    flat = tensor.contiguous().reshape(-1).view(torch.uint8)
    array: object = flat.numpy()
    return memoryview(array).cast("B")  # type: ignore[arg-type]


class ShardWriter:
    """Writes one output shard at `path`: its header at once, then each tensor in order,
    each buffer handed to `readback` as soon as it is in the file."""

    def __init__(self, path: Path, shard: OutShard, readback: ReadBack,
                 mode: int = 0o666) -> None:
        if sys.byteorder != "little":
            raise CheckpointError("convert writes safetensors on little-endian machines only")
        self.path = path
        self.shard = shard
        self._next = 0
        self._readback = readback
        # created with its final mode (`mode`, narrowed by the umask): never more readable
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        self._fh: Optional[BufferedWriter] = os.fdopen(fd, "wb")
        readback.begin(path)
        self._written(_header(shard))

    def _write(self, data: Union[bytes, memoryview]) -> None:
        assert self._fh is not None
        self._fh.write(data)

    def _written(self, data: Union[bytes, memoryview]) -> None:
        self._write(data)
        assert self._fh is not None
        self._fh.flush()  # the read-back reads through a descriptor of its own
        self._readback.wrote(data)

    @property
    def done(self) -> bool:
        return self._next == len(self.shard.pieces)

    def expects(self) -> Piece:
        return self.shard.pieces[self._next]

    def add(self, tensor: torch.Tensor) -> None:
        info = self.shard.infos[self._next]
        got = TensorInfo(str(tensor.dtype).replace("torch.", ""), tuple(tensor.shape))
        if got != info:  # the plan was checked against the headers: a file changed meanwhile
            raise CheckpointError(
                f"{self.expects().source} changed while it was read ({got} instead of {info})",
                fix="run convert again once nothing writes DIR",
            )
        self._written(_tensor_bytes(tensor))
        self._next += 1

    def finish(self) -> None:
        """Hand the file to the read-back, which fsyncs and closes it."""
        assert self._fh is not None
        fh, self._fh = self._fh, None
        self._readback.end(fh)

    def abort(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


@dataclass(frozen=True)
class WrittenFile:
    """An output shard as read back: its size, sha256 and what differed from the bytes
    meant to be there (nothing, normally)."""

    name: str
    size: int
    sha256: str
    problems: tuple[str, ...] = ()
    ident: Optional[Identity] = None  # from its descriptor, once fsynced

    @property
    def read(self) -> Read:
        """The file as read back (its identity from its descriptor)."""
        if self.ident is None:
            raise AssertionError(f"{self.name} was never fsynced")
        return Read(self.sha256, self.ident)


def reading_order(
    pieces: Sequence[Piece], file_of: Mapping[str, str], files: Sequence[str]
) -> list[list[Piece]]:
    """The pieces of each of `files`, in the plan's order: the order they are read and
    written in."""
    groups: dict[str, list[Piece]] = {f: [] for f in files}
    for piece in pieces:
        groups[file_of[piece.source]].append(piece)
    return [groups[f] for f in files]


def write_weights(
    directory: Path,
    files: Sequence[str],
    groups: Sequence[Sequence[Piece]],
    shards: Sequence[OutShard],
    staging: Path,
    on_source: Optional[Callable[[str, Read], None]] = None,
    progress: Optional[Callable[[str], None]] = None,
    mode: int = 0o666,
) -> list[WrittenFile]:
    """Stream every piece from DIR's weight `files` (in that order; `groups`: each one's
    pieces, from reading_order) into `shards` in `staging`, each shard read back and
    compared as it is written (convert/readback.py). `on_source(name, read)` is told
    each source file's hash (computed as the file is read, once) and identity. `mode`: the shards'
    (the umask narrows it)."""
    queue = list(shards)
    writer: Optional[ShardWriter] = None
    readback = ReadBack()
    buffers = Buffers(lambda: readback.told, readback.wait_compared)
    try:
        for number, (fname, pieces) in enumerate(zip(files, groups), 1):
            path = directory / fname
            started = time.monotonic()
            with _source_tensors(path, pieces, buffers) as (tensors, digest):
                for source_name, group in _grouped(pieces):
                    tensor = tensors(source_name)
                    for piece in group:
                        if writer is None:
                            writer = ShardWriter(staging / queue[0].name, queue.pop(0),
                                                 readback, mode)
                        if writer.expects() != piece:
                            raise AssertionError("output shards out of the reading order")
                        writer.add(cut(tensor, piece))
                        if writer.done:
                            writer.finish()
                            writer = None
                    del tensor
                source_read = digest()
            if on_source is not None:
                on_source(fname, source_read)
            if progress is not None:
                mb = path.stat().st_size / 1e6
                took = max(time.monotonic() - started, 1e-6)
                progress(f"shard {number}/{len(files)} {fname}: {mb:,.0f} MB in {took:.1f} s "
                         f"({mb / took:,.0f} MB/s)")
        if writer is not None or queue:
            raise AssertionError("some planned output shards were not written")
        return [WrittenFile(r.name, r.size, r.sha256, tuple(r.problems), r.ident)
                for r in readback.results()]
    finally:
        if writer is not None:
            writer.abort()
        readback.close()


@contextmanager
def _source_tensors(
    path: Path, pieces: Sequence[Piece], buffers: Optional[Buffers] = None
) -> Iterator[tuple[Callable[[str], torch.Tensor], Callable[[], Read]]]:
    """(tensor by name, the file's Read once all were taken). A safetensors file is
    read once, front to back, hashed on the way (`pieces` in its order: by_offset); a
    .bin file is hashed in a pass of its own, then loaded."""
    if path.name.endswith(".bin"):
        read = hash_file(path)  # torch loads it by path: checked again before publishing
        with open_source(path) as src:
            yield src.get, lambda: read
        return
    digest = BackgroundHash()
    seen: list[os.stat_result] = []
    stream = stream_safetensors(path, {p.source for p in pieces}, digest, buffers, seen)
    taken = False

    def tensor(name: str) -> torch.Tensor:
        nonlocal taken
        if taken and buffers is not None:
            buffers.done()  # the previous tensor was written
        taken = True
        got = next(stream, None)
        if got is None:
            raise CheckpointError(f"{path.name} changed while it was read (no {name} in it)",
                                  fix="run convert again once nothing writes DIR")
        if got[0] != name:
            raise AssertionError(f"{path.name}: pieces not in the file's order (by_offset)")
        return got[1]

    def finished() -> Read:
        if taken and buffers is not None:
            buffers.done()
        for _rest in stream:  # the bytes after the last wanted tensor, hashed
            pass
        return read_of(path.name, digest.hexdigest(), seen[0], seen[-1])

    try:
        yield tensor, finished
    finally:
        stream.close()
        digest.close()


def _grouped(pieces: Sequence[Piece]) -> Iterator[tuple[str, list[Piece]]]:
    """Consecutive pieces of one source tensor together: each source tensor is read once."""
    group: list[Piece] = []
    for piece in pieces:
        if group and group[0].source != piece.source:
            yield group[0].source, group
            group = []
        group.append(piece)
    if group:
        yield group[0].source, group
