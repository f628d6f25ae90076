"""Reading what a model folder holds: anyone with write access to it may have put anything
there (a FIFO where config.json should be, a 2 GB file, JSON nested 100,000 levels deep, a
journal whose paths climb out with `..`).

- `open_regular`/`read_regular` open only regular files, checked without blocking: a FIFO
  is opened with O_NONBLOCK and refused after fstat, so nothing ever waits for a writer;
- `load_json` parses bytes as strict UTF-8 JSON with a size and a depth limit and refuses
  duplicate keys;
- `relpath_problem` judges a recorded relative path by its text; `open_dir_under` walks to
  its folder one component at a time without following a symlink, so what is done there
  (through `dir_fd`) stays inside the root.

prestart's quick start imports this module: standard library only, and nothing that costs
milliseconds at import (no pathlib, typing, hashlib).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Callable, Optional, Union

    from qwen_kvprep.jsontypes import JSON, JSONObject

    PathArg = Union[str, "os.PathLike[str]"]

# Our own records (journal.json, state.json, view.json) are a few KiB.
RECORD_LIMIT = 1 << 20
RECORD_DEPTH = 16
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


class NotRegularFile(OSError):
    """A path that holds something other than a regular file (a FIFO, a folder...)."""

    def __init__(self, path: PathArg, what: str) -> None:
        super().__init__(errno.EINVAL, f"is {what}, not a regular file", os.fspath(path))
        self.what = what

    def __str__(self) -> str:
        return f"{self.filename} {self.strerror}"


class TooLarge(OSError):
    def __init__(self, path: PathArg, size: int, limit: int) -> None:
        super().__init__(
            errno.EFBIG, f"is {size:,} bytes, more than the {limit:,} allowed", os.fspath(path)
        )
        self.size = size
        self.limit = limit

    def __str__(self) -> str:
        return f"{self.filename} {self.strerror}"


def kind_of(mode: int) -> str:
    """'a FIFO', 'a folder'... for a st_mode that is not a regular file."""
    for test, what in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISLNK, "a symlink"),
    ):
        if test(mode):
            return what
    return "not a regular file"


def open_regular(path: PathArg, follow: bool = True, dir_fd: Optional[int] = None) -> int:
    """A read-only descriptor of the regular file at `path`; NotRegularFile for anything
    else. Never blocks: O_NONBLOCK makes opening a FIFO return at once (and it is refused);
    on a regular file the flag changes nothing."""
    flags = os.O_RDONLY | os.O_NONBLOCK | _CLOEXEC | (0 if follow else _NOFOLLOW)
    try:
        fd = os.open(path, flags, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ENXIO, errno.ELOOP, errno.EOPNOTSUPP):
            # a socket (ENXIO) or, with follow=False, a symlink (ELOOP): say what it is
            try:
                st = os.stat(path, dir_fd=dir_fd, follow_symlinks=follow)
            except OSError:
                raise exc from None
            if not stat.S_ISREG(st.st_mode):
                raise NotRegularFile(path, kind_of(st.st_mode)) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(path, kind_of(st.st_mode))
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_fd(fd: int, limit: Optional[int], path: PathArg = "") -> bytes:
    """The whole content of an open file, at most `limit` bytes (TooLarge beyond)."""
    size = os.fstat(fd).st_size
    if limit is not None and size > limit:
        raise TooLarge(path, size, limit)
    chunks = []
    total = 0
    while True:
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
        if limit is not None and total > limit:  # it grew while being read
            raise TooLarge(path, total, limit)
    return b"".join(chunks)


def read_regular(
    path: PathArg, limit: Optional[int] = None, follow: bool = True, dir_fd: Optional[int] = None
) -> bytes:
    """The bytes of a regular file (symlinks followed unless follow=False)."""
    fd = open_regular(path, follow=follow, dir_fd=dir_fd)
    try:
        return read_fd(fd, limit, path)
    finally:
        os.close(fd)


def read_prefix(path: PathArg, size: int) -> tuple[bytes, int]:
    """(the first `size` bytes, the file's full size) of a regular file."""
    fd = open_regular(path)
    try:
        total = os.fstat(fd).st_size
        out = []
        want = size
        while want > 0:
            chunk = os.read(fd, min(want, 1 << 20))
            if not chunk:
                break
            out.append(chunk)
            want -= len(chunk)
        return b"".join(out), total
    finally:
        os.close(fd)


def regular_or_absent(path: PathArg) -> Optional[str]:
    """Why `path` cannot be read as a regular file (None: it is one, or nothing is there).
    A symlink to a regular file is fine; a dangling one counts as absent."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot be examined: {exc.strerror or exc}"
    if stat.S_ISREG(st.st_mode):
        return None
    return f"is {kind_of(st.st_mode)}, not a regular file"


# ------------------------------------------------------------------ JSON


class DuplicateKey(ValueError):
    pass


def _unique(pairs: list[tuple[str, JSON]]) -> JSONObject:
    out: JSONObject = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKey(f"the key {key!r} appears twice in one object")
        out[key] = value
    return out


def depth(value: JSON, limit: int) -> int:
    """How deeply `value` nests lists and objects, counted up to limit + 1 (no recursion)."""
    deepest = 0
    stack: list[tuple[JSON, int]] = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (dict, list)):
            if level > deepest:
                deepest = level
                if deepest > limit:
                    return deepest
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, level + 1) for child in children)
    return deepest


def load_json(
    raw: bytes,
    max_depth: int = RECORD_DEPTH,
    pairs_hook: Optional[Callable[[list[tuple[str, JSON]]], JSON]] = None,
) -> JSON:
    """Strict UTF-8 JSON with unique keys, nested at most `max_depth` levels.

    Raises UnicodeDecodeError, json.JSONDecodeError (both ValueError), DuplicateKey or
    ValueError (too deep), never RecursionError."""
    text = raw.decode("utf-8")
    hook = pairs_hook or _unique
    try:
        data: JSON = json.loads(text, object_pairs_hook=hook)
    except RecursionError:
        raise ValueError(f"it nests more than {max_depth} levels deep") from None
    if depth(data, max_depth) > max_depth:
        raise ValueError(f"it nests more than {max_depth} levels deep")
    return data


def json_error_at(exc: json.JSONDecodeError) -> tuple[str, int, int]:
    """(what is wrong, line, column) of a JSON syntax error, where a person would fix it.

    The parser stops at the first character it cannot take, which for the commonest
    mistakes is past the real one: a missing comma is reported at the start of the next
    member (often the next line), a trailing comma at the closing bracket (after any blank
    lines), a cut-off file at its end. For those, point just after the last thing before
    the gap, and say what is wrong there."""
    doc, pos = exc.doc, exc.pos
    back = pos
    while back > 0 and doc[back - 1] in " \t\r\n":
        back -= 1
    here, before = doc[pos : pos + 1], doc[back - 1 : back]
    what = exc.msg
    at = pos
    if back > 0:
        trailing = before == "," and (here in ("}", "]") or pos >= len(doc))
        if trailing and exc.msg.startswith(("Expecting property name", "Expecting value")):
            what, at = "a trailing ',' (JSON allows none before a closing bracket)", back - 1
        elif pos >= len(doc):
            what, at = "the text is cut off: it ends", back
        elif exc.msg.startswith("Expecting ',' delimiter"):
            what, at = "missing ',': it belongs", back
    line = doc.count("\n", 0, at) + 1
    column = at - doc.rfind("\n", 0, at)
    return what, line, column


def describe_json_error(exc: BaseException) -> str:
    """A sentence fragment for why bytes are not acceptable JSON."""
    if isinstance(exc, UnicodeDecodeError):
        return f"is not UTF-8 (byte {exc.start} is 0x{exc.object[exc.start]:02x})"
    if isinstance(exc, json.JSONDecodeError):
        what, line, column = json_error_at(exc)
        return f"is not valid JSON ({what} at line {line}, column {column})"
    if isinstance(exc, DuplicateKey):
        return f"is ambiguous JSON: {exc}"
    if isinstance(exc, NotRegularFile):
        return exc.strerror or "is not a regular file"
    if isinstance(exc, OSError):
        return f"cannot be read ({exc.strerror or exc})"
    return f"is not acceptable: {exc}"


def read_record(path: PathArg, limit: int = RECORD_LIMIT, max_depth: int = RECORD_DEPTH) -> JSON:
    """One of our own JSON records from a folder we do not control: a regular file, at most
    `limit` bytes, strict JSON. Raises OSError (FileNotFoundError when absent) or
    ValueError."""
    return load_json(read_regular(path, limit), max_depth)


# ------------------------------------------------------------------ recorded paths


def relpath_problem(rel: object) -> Optional[str]:
    """Why `rel` may not name a file below a root (None when it may): it must be a
    non-empty relative POSIX path in normal form, without `..`, `.` or empty parts."""
    if not isinstance(rel, str) or not rel:
        return "is not a relative path"
    if "\x00" in rel:
        return "contains a NUL byte"
    if rel.startswith("/") or "\\" in rel or (len(rel) > 1 and rel[1] == ":"):
        return "is an absolute path"
    parts = rel.split("/")
    if ".." in parts:
        return "climbs out with `..`"
    if any(p in ("", ".") for p in parts):
        return "is not in normal form"
    return None


def open_dir_under(root: PathArg, parts: Sequence[str], create: bool = False) -> int:
    """A descriptor of `root/parts...`, reached one component at a time with O_NOFOLLOW: a
    component that is a symlink (or not a folder) raises OSError (ELOOP/ENOTDIR) instead of
    being followed out of `root`. `root` itself is the caller's and may be a link. With
    create, missing folders are made (0o755 before umask)."""
    fd = os.open(root, os.O_RDONLY | _DIRECTORY | _CLOEXEC)
    try:
        for part in parts:
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=fd)
            nxt = os.open(part, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def lstat_at(fd: int, name: str) -> Optional[os.stat_result]:
    try:
        return os.stat(name, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def first_link_below(root: PathArg, path: PathArg, also: Sequence[str] = ()) -> Optional[str]:
    """The first component of `path` strictly below `root` (then `path/also...`, one by one)
    that is a symbolic link, or None: none is, or the walk reaches a component that does not
    exist yet, or `path` is not below `root`. `root` itself is the caller's and may be a link.
    For a check before a write (a write that goes through open_dir_under fails on the same
    link, later and with less to say)."""
    rel = os.path.relpath(os.path.abspath(path), os.path.abspath(root))
    if rel == os.pardir or rel.startswith(os.pardir + os.sep) or os.path.isabs(rel):
        return None
    parts = [p for p in rel.split(os.sep) if p not in ("", os.curdir)] + list(also)
    here = os.path.abspath(root)
    for part in parts:
        here = os.path.join(here, part)
        try:
            st = os.lstat(here)
        except OSError:
            return None
        if stat.S_ISLNK(st.st_mode):
            return here
    return None
