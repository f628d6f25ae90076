"""Where convert writes: OUT's rules, the staging folder, its lock, the publish.

- OUT must not exist, or be an empty folder; it must not lie inside DIR, nor DIR inside it.
  Places are told apart by device and inode, not by how they are spelt: a link, a bind
  mount or a second mount of DIR's file system leads to where the bytes would go.
- Everything is written into a staging folder and published at the very end, so OUT never
  holds a half-written model:
  - OUT absent: the staging folder `.<OUT name>.convert-partial` beside OUT is renamed to
    OUT (OUT appears complete or not at all);
  - OUT an existing empty folder (an admin's folder, a mounted volume): the staging folder
    `.qwen-kvprep-convert-partial` INSIDE it, on OUT's own device, whose files are moved
    into OUT (config.json last, so a loader takes OUT for a model only once it is whole).
    OUT itself is never replaced: its owner, group and mode (setgid included) stay, and a
    mount point is never the target of a rename (the kernel refuses that with EBUSY).
- The claim file beside the staging folder (`.<OUT name>.convert-claim`, or
  `.qwen-kvprep-convert-claim` inside OUT) says the staging folder is ours; it is written
  first and removed last, so what a kill at any moment leaves is recognisable as ours.
  Inside OUT it lists, before the files are moved, the names it moves.
- The lock file (`.<OUT name>.convert-lock` beside OUT, or `.qwen-kvprep-convert-lock`
  inside it; filelock: the kernel drops it when its holder dies) keeps two converts from
  writing the same OUT; it is removed at the end. Under it, what a killed run left (the
  staging folder, the files its claim lists) is removed and the conversion starts afresh,
  so the same command finishes what a kill cut short; and OUT is checked again, so a
  second convert that waited says that another one finished OUT. A folder at the staging
  name without our claim is not ours: refused, never removed. The claim and lock a kill
  right after publishing left with a complete OUT are removed by the next run (`tidy`).
- No output file is more readable than what it is made from: the weights keep at most the
  modes of DIR's weight files, the other files at most those of DIR's config.json. Not
  even while staged: files are created with those modes, in a staging folder of mode 0700
  (given a new folder's mode only as it becomes OUT), so a kill leaves nothing readable.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import stat
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import filelock

from qwen_kvprep.convert.outname import suggested_out
from qwen_kvprep.errors import (
    FileSystemError,
    KvprepError,
    LockTimeout,
    RefusedError,
    UsageError,
    os_failure,
)
from qwen_kvprep.fsutil import TEMP_NAME, atomic_write_text, fsync_dir, is_mount, remove_tree
from qwen_kvprep.probe.converted import LOST_FOUND

STAGING_SUFFIX = ".convert-partial"
LOCK_SUFFIX = ".convert-lock"
CLAIM_SUFFIX = ".convert-claim"
INSIDE = ".qwen-kvprep"  # the names inside an existing OUT: INSIDE + "-convert-partial" ...
MARKER = ".qwen-kvprep-convert"  # inside a staging folder of an older release: ours too
_CLAIM_HEAD = "qwen-kvprep convert staging"
_CLAIM_LIMIT = 1 << 20
_LAST = "config.json"  # published last: what a loader looks for first


@dataclass(frozen=True)
class Place:
    """Where convert stages and locks OUT: beside it when it is new, inside it when it is
    an existing (empty) folder."""

    out: Path
    inside: bool

    @property
    def base(self) -> Path:
        return self.out if self.inside else self.out.parent

    def _name(self, suffix: str) -> Path:
        stem = f"{INSIDE}-convert" if self.inside else f".{self.out.name}.convert"
        return self.base / (stem + suffix[len(".convert"):])

    @property
    def staging(self) -> Path:
        return self._name(STAGING_SUFFIX)

    @property
    def lock(self) -> Path:
        return self._name(LOCK_SUFFIX)

    @property
    def claim(self) -> Path:
        return self._name(CLAIM_SUFFIX)


def place_of(out: Path) -> Place:
    return Place(out, out.is_dir() and not out.is_symlink())


def staging_of(out: Path) -> Path:
    return place_of(out).staging


def lock_of(out: Path) -> Path:
    return place_of(out).lock


def _identity(path: Path) -> Optional[tuple[int, int]]:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _chain(path: Path) -> Iterator[tuple[int, int]]:
    """(st_dev, st_ino) of `path` (or its nearest existing ancestor) and of every folder
    above it on its real path: what a bind mount of a folder shares with the folder."""
    real = Path(os.path.realpath(path))
    while not os.path.lexists(real) and real.parent != real:
        real = real.parent
    while True:
        ident = _identity(real)
        if ident is not None:
            yield ident
        if real.parent == real:
            return
        real = real.parent


def _claimed(place: Place) -> Optional[list[str]]:
    """None without a claim of ours; else the names of OUT it lists (inside OUT only)."""
    try:  # O_NONBLOCK: a FIFO in its place must not stall the run
        fd = os.open(place.claim, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
            return None
        text = fh.read(_CLAIM_LIMIT).decode("utf-8", errors="replace")
    lines = text.split("\n")
    if lines[0] != _CLAIM_HEAD:
        return None
    if not place.inside:
        return []
    return [n for n in lines[1:] if n and n == os.path.basename(n) and n not in (".", "..")
            and not n.startswith(INSIDE)]


def _ours(place: Place, name: str, claimed: Sequence[str]) -> bool:
    """Whether the entry `name` of OUT is one of convert's own (inside OUT only)."""
    own = {place.staging.name, place.lock.name, place.claim.name}
    temp = TEMP_NAME.match(name)  # an atomic write of the claim cut short
    return name in own or name in claimed or (temp is not None and f".{temp.group(1)}" in own)


def _foreign(place: Place) -> list[str]:
    """OUT's entries that are not convert's own staging, lock and claim, nor the
    lost+found folder of a freshly formatted volume (ext4, xfs) mounted at OUT."""
    entries = os.listdir(place.out)
    if not place.inside:
        return entries
    claimed = _claimed(place) or []
    fresh = LOST_FOUND in entries and _real_dir(place.out / LOST_FOUND) and is_mount(place.out)
    return [e for e in entries if not _ours(place, e, claimed)
            and not (fresh and e == LOST_FOUND)]


def _real_dir(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink()


def check_out(src: Path, out: Path) -> None:
    """UsageError unless OUT may be written: absent or an empty folder, apart from DIR, in a
    folder that exists. Reads only."""
    q = shlex.quote
    if out.name in ("", ".", ".."):
        raise UsageError(f"OUT {out}: name the folder to create (e.g. {q(str(out))}/qwen2)")
    src_id, out_id = _identity(src), _identity(out)
    if src_id is not None and src_id in set(_chain(out)):
        real_src = Path(os.path.realpath(src))
        raise UsageError(
            f"OUT {out} lies inside DIR {src} (the same folder, through a link or a mount): "
            "convert never writes into the checkpoint",
            fix="name a folder outside it, e.g. " + q(str(suggested_out(real_src))),
        )
    if out_id is not None and out_id in set(_chain(src)):
        raise UsageError(
            f"DIR {src} lies inside OUT {out}: OUT would contain the checkpoint it is made from",
            fix="name an OUT folder beside DIR, not above it",
        )
    parent = out.parent
    if not parent.is_dir():
        raise UsageError(
            f"OUT {out}: the folder {parent} does not exist",
            fix=f"create it first (mkdir -p {q(str(parent))})",
        )
    if os.path.lexists(out):
        if out.is_symlink() or not out.is_dir():
            what = "a symlink" if out.is_symlink() else "not a folder"
            raise UsageError(
                f"OUT {out} exists and is {what}: convert creates OUT as a folder of its own "
                "(renamed into place at the end)",
                fix="name a new folder (convert creates it)",
            )
        try:
            entries = _foreign(place_of(out))
        except OSError as exc:
            raise os_failure(exc, parent, output_option=False) from exc
        if entries:
            raise _not_empty(out, entries)


def _not_empty(out: Path, entries: list[str]) -> UsageError:
    q = shlex.quote
    shown = ", ".join(sorted(entries)[:3]) + (" ..." if len(entries) > 3 else "")
    if is_mount(out):  # `rm -r` of it would empty it, lost+found too, then fail (EBUSY)
        fix = (
            f"name a new folder, or, if what it holds is not needed, empty it (it is a mount "
            f"point: the folder itself stays): find {q(str(out))} -mindepth 1 -maxdepth 1 ! "
            f"-name {LOST_FOUND} -exec rm -r --one-file-system {{}} +"
        )
    else:
        fix = (f"name a new folder, or remove this one first (rm -r {q(str(out))}) if it "
               "holds nothing you need")
    return UsageError(
        f"OUT {out} exists and is not empty ({shown}): convert writes a new folder "
        "and never mixes its files with others",
        fix=fix,
    )


def check_space(out: Path, needed: int) -> None:
    """FileSystemError when the device the bytes go to has less than `needed` bytes: OUT's
    own when it exists (a mounted volume), else the folder it is created in."""
    place = place_of(out)
    where = place.base
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        return
    free += _reclaimable(place)  # a killed run's leftovers go before the first write
    if free < needed:
        raise FileSystemError(
            f"not enough space for OUT: {_size(needed)} to write, {_size(free)} free on the "
            f"device holding {where}",
            fix=f"free some space there (`df -h {shlex.quote(str(where))}` shows it) or "
            "name an OUT on another disk; nothing was written",
        )


def _reclaimable(place: Place) -> int:
    """The bytes on disk of what a killed run left that staged() removes: its staging
    folder (when ours) and the files its claim lists."""
    staging = place.staging
    ours = _claimed(place) is not None or (staging / MARKER).is_file()
    if not ours or staging.is_symlink():
        return 0
    paths = [place.out / n for n in _claimed(place) or []]
    for folder, _dirs, files in os.walk(staging):  # links are not followed
        paths += [Path(folder) / f for f in files]
    total = 0
    for path in paths:
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode):
                total += st.st_blocks * 512
    return total


def _size(n: int) -> str:
    return f"{n / 1e9:,.2f} GB" if n >= 1e9 else f"{n / 1e6:,.1f} MB"


def no_space(exc: OSError, out: Path) -> KvprepError:
    """The error for a write refused with ENOSPC (or any OSError) while staging OUT: the
    device named is the one written, OUT's own when OUT exists (a mounted volume)."""
    where = place_of(out).base
    err = os_failure(exc, where, output_option=False)
    if "no space left" in err.message:
        err.fix = (
            f"free some space on the device holding {where} (`df -h "
            f"{shlex.quote(str(where))}`) and run the same command again: it starts "
            "afresh (the partial output was removed)"
        )
    return err


def take_lock(place: Place, timeout: float = 0.0) -> filelock.FileLock:
    """OUT's lock, held (LockTimeout when another convert holds it)."""
    lock = filelock.FileLock(str(place.lock), timeout=timeout)
    try:
        lock.acquire()
    except filelock.Timeout as exc:
        raise LockTimeout(
            f"another convert is writing {place.out} (it holds {place.lock})",
            fix="wait for it to finish; a killed one releases the lock at once",
        ) from exc
    except OSError as exc:
        raise os_failure(exc, place.base, output_option=False) from exc
    return lock


@contextlib.contextmanager
def staged(out: Path, timeout: float = 0.0) -> Iterator[Path]:
    """The fresh staging folder for OUT, under OUT's lock, for the `with` block; removed if
    the block raises. `publish` puts it in place as OUT inside the block."""
    place = place_of(out)
    try:
        _check_again(place)  # first without the lock: not even a lock file in a finished OUT
    except OSError as exc:
        raise os_failure(exc, place.base, output_option=False) from exc
    lock = take_lock(place, timeout)
    try:
        try:
            _clear_stale(place)
            _check_again(place)
            atomic_write_text(place.claim, _CLAIM_HEAD + "\n")
            # the owner's alone until published: nobody else reads a file staged in it,
            # during the run or after a kill (a setgid bit of the folder above stays)
            place.staging.mkdir(0o700)
        except OSError as exc:
            raise os_failure(exc, place.base, output_option=False) from exc
        try:
            yield place.staging
        except BaseException:
            with contextlib.suppress(OSError, KvprepError):
                _clear_stale(place)
            raise
    finally:
        with contextlib.suppress(OSError):
            place.lock.unlink()  # while held: a waiter then finds OUT complete and refuses
        lock.release()


def tidy(out: Path) -> None:
    """Remove what a convert killed right after publishing left with the complete OUT:
    the claim and lock beside it (its staging folder is OUT now), or inside it the claim,
    the lock and the emptied staging folder. Only under the lock, taken without waiting:
    a convert that holds it is running, and its files stay. What is not ours stays, and
    so does a staging folder that still holds anything (staged() judges it)."""
    for place in (Place(out, False), Place(out, True)):
        if any(os.path.lexists(p) for p in (place.claim, place.lock, place.staging)):
            _tidy(place)


def own_names(out: Path) -> set[str]:
    """The names of convert's own files inside an existing OUT (staging, claim, lock)."""
    place = Place(out, True)
    return {place.staging.name, place.claim.name, place.lock.name}


def _tidy(place: Place) -> None:
    lock = filelock.FileLock(str(place.lock), timeout=0)
    try:
        lock.acquire()
    except (filelock.Timeout, OSError):
        return
    try:
        claimed = _claimed(place) is not None
        if os.path.lexists(place.staging):
            if not claimed or not _real_dir(place.staging) or os.listdir(place.staging):
                return
            place.staging.rmdir()
        if claimed:
            place.claim.unlink()
        if not os.path.lexists(place.claim):
            place.lock.unlink()  # while held, as staged() does
        fsync_dir(place.base)
    except OSError:
        pass  # a folder that is not writable: they stay, as harmless as before
    finally:
        lock.release()


def _check_again(place: Place) -> None:
    """Under the lock: OUT is still free. Another convert may have finished it since
    check_out, while this one was reading DIR."""
    out = place.out
    if place.inside:
        entries = _foreign(place)
        if not entries:
            return
    elif not os.path.lexists(out):
        return
    else:
        entries = []
    raise RefusedError(
        f"another convert finished {out} while this one was checking DIR: nothing was "
        "written by this one"
        + (f" (OUT now holds {', '.join(sorted(entries)[:3])})" if entries else ""),
        fix=f"use {shlex.quote(str(out))} as it is (its provenance.json says what it was "
        "made from), or name a new OUT",
    )


def _clear_stale(place: Place) -> None:
    """Remove what a killed run left: its staging folder and the files its claim lists,
    then the claim. A staging folder without our claim is not ours: refused."""
    staging = place.staging
    claimed = _claimed(place)
    claim = claimed is not None
    if os.path.lexists(staging):
        legacy = (staging / MARKER).is_file() and not staging.is_symlink()
        if staging.is_symlink() or not staging.is_dir() or not (claim or legacy):
            raise UsageError(
                f"{staging} exists and was not made by convert: it is left alone",
                fix=f"move it away (it is the name convert stages OUT in): mv "
                f"{shlex.quote(str(staging))} SOMEWHERE",
            )
        if not remove_tree(staging):  # a killed run's partial output: start afresh
            raise FileSystemError(
                f"{staging}, what a killed convert left, cannot be removed entirely (a mount "
                "inside it is never crossed, and stays)",
                fix=f"see what is left there (ls -la {shlex.quote(str(staging))}), unmount or "
                "move it away, then run the same command again",
            )
    for name in claimed or []:  # moved into OUT by a publish that a kill cut short
        path = place.out / name
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISREG(os.lstat(path).st_mode):
                path.unlink()
    if claim:
        place.claim.unlink()
        fsync_dir(place.base)
    if place.inside:  # an atomic write of the claim cut short
        for name in os.listdir(place.out):
            temp = TEMP_NAME.match(name)
            if temp is not None and f".{temp.group(1)}" == place.claim.name:
                with contextlib.suppress(FileNotFoundError):
                    (place.out / name).unlink()


def source_modes(src: Path, weight_files: Iterable[str]) -> tuple[int, int]:
    """The permission bits OUT's files may have at most: (weights, other files), from
    DIR's weight files and DIR's config.json (a link is followed: the bytes' own file).
    Who may read follows DIR; the owner's write bit stays (a read-only DIR, a mounted
    snapshot say, does not make OUT's files read-only to the user who made them)."""

    def bits(path: Path) -> int:
        try:
            return stat.S_IMODE(os.stat(path).st_mode) & 0o666 | 0o200
        except OSError:
            return 0o644

    weights = 0o666
    for name in weight_files:
        weights &= bits(src / name)
    return weights, bits(src / "config.json")


def umask() -> int:
    """This process's umask, read without changing it where the kernel says it (a
    change and a change back would race with a thread creating a file)."""
    with contextlib.suppress(OSError, ValueError), open(
        "/proc/self/status", encoding="ascii", errors="replace"
    ) as fh:
        for line in fh:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _restrict(staging: Path, modes: tuple[int, int]) -> None:
    weights, others = modes
    for entry in os.scandir(staging):
        if not entry.is_file(follow_symlinks=False):
            continue
        cap = weights if entry.name.endswith((".safetensors", ".safetensors.index.json")) \
            else others
        mode = stat.S_IMODE(entry.stat(follow_symlinks=False).st_mode)
        if mode & ~cap:
            os.chmod(entry.path, mode & cap)


def publish(staging: Path, out: Path, modes: Optional[tuple[int, int]] = None) -> None:
    """Put the complete staging folder in place as OUT: renamed to OUT when new, its files
    moved into OUT when OUT is an existing folder. `modes`: source_modes' caps."""
    place = Place(out, staging.parent == out)
    try:
        if modes is not None:
            _restrict(staging, modes)
        fsync_dir(staging)
        if place.inside:
            names = sorted(os.listdir(staging), key=lambda n: (n == _LAST, n))
            atomic_write_text(place.claim, "\n".join([_CLAIM_HEAD, *names]) + "\n")
            for name in names:
                os.rename(staging / name, out / name)
            staging.rmdir()
        else:
            # the folder's modes as a new folder of this user's gets them, as OUT
            os.chmod(staging, 0o777 & ~umask() | stat.S_IMODE(os.stat(staging).st_mode) & 0o7000)
            os.replace(staging, out)
        fsync_dir(place.base)
        place.claim.unlink()  # last: until then what is there is recognisably ours
        fsync_dir(place.base)
    except OSError as exc:
        raise os_failure(exc, place.base, output_option=False) from exc
