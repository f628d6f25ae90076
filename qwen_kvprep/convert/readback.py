"""Each output shard read back from its file as it is written, on a thread of its own.

The writer tells `ReadBack` each buffer right after it is in the file (`wrote`); the thread
reads the same bytes back through a descriptor of its own (the page cache still holds
them), compares them byte for byte with the buffer, which is still in memory, and feeds
what it read to the shard's sha256: the hash provenance records is the one of the bytes in
the file, and every byte of it was compared with the byte meant to be there. Each source
byte was hashed once as it was read (weights.stream_safetensors), each written byte is
hashed once as it is read back: two passes of sha256 over the model, no third.

Each finished shard is fsynced and closed on a third thread, so the disk writes one shard
while the next is read, converted and compared. The writer waits while more than `window` bytes are
written but not yet compared (one larger buffer alone is let through): the buffers it holds
are memory, and the thread must not fall a whole shard behind.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from io import BufferedReader
from pathlib import Path
from typing import IO, Any, Optional, Union

from qwen_kvprep.convert.reads import Identity, identity

_CHUNK = 8 << 20
_WINDOW = 512 << 20

Buffer = Union[bytes, memoryview]


@dataclass
class ReadBackResult:
    """One shard: its size and sha256 as read back, and what differed."""

    name: str
    size: int = 0
    sha256: str = ""
    problems: list[str] = field(default_factory=list)
    # the file's identity from its own descriptor once it was fsynced: what provenance
    # records, and what is checked again before OUT is published
    ident: Optional[Identity] = None


class ReadBack:
    """`begin(path)`, `wrote(buffer)` for each buffer in file order, `end(fh)` per shard;
    `results()` once all were written; `close()` on every way out."""

    def __init__(self, window: int = _WINDOW) -> None:
        self._window = window
        self._items: queue.Queue[Optional[tuple[str, object]]] = queue.Queue()
        self._told = 0  # bytes told, all shards together
        self._compared = 0  # of those, bytes compared (or dropped) and let go of
        self._cond = threading.Condition()
        self._error: Optional[BaseException] = None  # an OSError of fsync, raised to the writer
        self._done: list[ReadBackResult] = []
        self._stop = False
        # a shard's fsync waits for the disk: on a thread of its own, the read-back goes on
        # with the next shard meanwhile (as `cp -r && sync` lets the disk write while it reads)
        self._sync = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvprep-fsync")
        self._thread = threading.Thread(target=self._run, name="kvprep-readback", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- the writer's side

    def begin(self, path: Path) -> None:
        """A shard's file was created at `path` (empty)."""
        self._raise()
        self._items.put(("begin", path))

    def wrote(self, data: Buffer) -> None:
        """`data` is now the next bytes of the current shard's file (flushed); it must stay
        unchanged until it is compared."""
        n = memoryview(data).nbytes
        with self._cond:
            self._cond.wait_for(
                lambda: self._told == self._compared
                or self._told - self._compared + n <= self._window
                or self._error is not None
            )
            self._told += n
        self._raise()
        self._items.put(("data", data))

    @property
    def told(self) -> int:
        """Bytes told so far, all shards together: a position for `wait_compared`."""
        return self._told

    def wait_compared(self, position: int) -> None:
        """Wait until every buffer told before `position` was compared and let go of (its
        memory may then be used again)."""
        with self._cond:
            self._cond.wait_for(lambda: self._compared >= position or self._error is not None)
        self._raise()

    def end(self, fh: IO[bytes]) -> None:
        """The current shard is complete: flushed, fsynced and closed on the thread."""
        self._raise()
        self._items.put(("end", fh))

    def results(self) -> list[ReadBackResult]:
        """Every shard's result, once the thread has caught up (raises an fsync's OSError)."""
        self._items.put(None)
        self._thread.join()
        self._sync.shutdown(wait=True)
        self._raise()
        return list(self._done)

    def close(self) -> None:
        """Stop, dropping what is left (every handle handed over is closed)."""
        self._stop = True
        self._items.put(None)
        self._thread.join()
        self._sync.shutdown(wait=True)
        while not self._items.empty():  # left behind by a thread that failed
            item = self._items.get_nowait()
            if item is not None and item[0] == "end":
                item[1].close()  # type: ignore[attr-defined]

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    # ---------------------------------------------------------------- the thread

    def _run(self) -> None:
        reader: Optional[BufferedReader] = None
        current: Optional[ReadBackResult] = None
        digest = hashlib.sha256()
        chunk = bytearray(_CHUNK)
        try:
            while True:
                item = self._items.get()
                if item is None:
                    return
                kind, value = item
                if kind == "end":
                    fh: IO[bytes] = value  # type: ignore[assignment]
                    self._finish(fh, reader, current, digest)
                    reader, current = None, None
                    continue
                if self._stop or self._error is not None:
                    if kind == "data":
                        self._release(memoryview(value).nbytes)  # type: ignore[arg-type]
                    continue
                if kind == "begin":
                    path: Path = value  # type: ignore[assignment]
                    current, digest = ReadBackResult(path.name), hashlib.sha256()
                    try:
                        reader = open(path, "rb")  # noqa: SIM115 (closed at "end")
                    except OSError as exc:
                        current.problems.append(f"{path.name} cannot be read back: {exc}")
                    continue
                data = memoryview(value).cast("B")  # type: ignore[arg-type]
                try:
                    if reader is not None and current is not None and not current.problems:
                        self._compare(reader, data, current, digest, chunk)
                finally:
                    self._release(data.nbytes)
        except BaseException as exc:  # handed to the writer's thread
            self._fail(exc)
        finally:
            if reader is not None:
                reader.close()

    def _compare(self, reader: BufferedReader, data: memoryview, current: ReadBackResult,
                 digest: Any, chunk: bytearray) -> None:
        at = 0
        while at < data.nbytes:
            want = min(len(chunk), data.nbytes - at)
            into = chunk if want == len(chunk) else bytearray(want)
            got = reader.readinto(into)
            if got != want:
                current.problems.append(
                    f"{current.name} is shorter than what was written (at byte "
                    f"{current.size + max(got, 0):,})")
                return
            digest.update(into)
            if into != data[at:at + want]:  # memcmp: a bytearray against a buffer
                first = next(i for i in range(want) if into[i] != data[at + i])
                current.problems.append(
                    f"{current.name} does not hold what was written (byte "
                    f"{current.size + first:,} differs)")
                return
            at += want
            current.size += want

    def _finish(self, fh: IO[bytes], reader: Optional[BufferedReader],
                current: Optional[ReadBackResult], digest: Any) -> None:
        self._sync.submit(self._fsync, fh, current)
        if reader is not None:
            if current is not None and not current.problems and reader.read(1):
                current.problems.append(f"{current.name} is longer than what was written")
            reader.close()
        if current is not None and not self._stop:
            current.sha256 = digest.hexdigest()
            self._done.append(current)

    def _fsync(self, fh: IO[bytes], current: Optional[ReadBackResult]) -> None:
        try:
            if not self._stop:
                fh.flush()
                os.fsync(fh.fileno())
                if current is not None:
                    current.ident = identity(os.fstat(fh.fileno()))
        except OSError as exc:
            self._fail(exc)
        finally:
            fh.close()

    def _release(self, n: int) -> None:
        with self._cond:
            self._compared += n
            self._cond.notify_all()

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = exc
            self._cond.notify_all()
