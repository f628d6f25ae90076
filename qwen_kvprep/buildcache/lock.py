"""One build per key at a time, across processes, with a bounded and reported wait.

filelock takes an OS lock (flock) on `<cache>/locks/<key>.lock`: the kernel drops it when
its holder dies, so a killed build never leaves a lock that blocks the next one (unlike
torch's own JIT `lock` file). The holder writes who it is to `<key>.owner` so a waiter can
say whom it waits for; a stale owner file is harmless because it is only read while the
lock is really held.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import time
from collections.abc import Iterator
from datetime import datetime
from typing import TYPE_CHECKING, Callable, Optional

import filelock

from qwen_kvprep.buildcache.paths import CacheLayout
from qwen_kvprep.common import ENV_LOCK_TIMEOUT
from qwen_kvprep.dirlock import take
from qwen_kvprep.errors import LockTimeout, UsageError
from qwen_kvprep.fsutil import atomic_write_text

if TYPE_CHECKING:
    from qwen_kvprep.jsontypes import JSON, JSONObject

DEFAULT_LOCK_TIMEOUT = 600.0


def seconds(raw: str, name: str) -> float:
    """`raw`, given as `name` (an option or an environment variable), as a number of
    seconds: finite and not negative (nan, inf, -1 and words are refused, not taken as 0
    or as forever)."""
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise UsageError(
            f"{name}={raw!r} is not a number of seconds (a finite number, 0 or more)",
            fix=f"export {name}={DEFAULT_LOCK_TIMEOUT:.0f}"
            if name.startswith("QWEN_")
            else f"{name} {DEFAULT_LOCK_TIMEOUT:.0f}",
        )
    return value


def lock_timeout(option: Optional[float] = None) -> float:
    """Seconds to wait for another builder: option > $QWEN_KVPREP_LOCK_TIMEOUT > 600."""
    if option is not None:
        return seconds(str(option), "--lock-timeout")
    raw = os.environ.get(ENV_LOCK_TIMEOUT, "").strip()
    if not raw:
        return DEFAULT_LOCK_TIMEOUT
    return seconds(raw, ENV_LOCK_TIMEOUT)


def read_owner(layout: CacheLayout, key: str) -> Optional[JSONObject]:
    """Who holds the key's lock, as its holder wrote it: {"pid", "host", "since"} (read as
    plain JSON: only shown, and every field has a default)."""
    try:
        data: JSON = json.loads(layout.owner_path(key).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def describe_owner(owner: Optional[JSONObject]) -> str:
    if not owner:
        return "held by another process (it has not said who it is yet)"
    since = owner.get("since")
    when = (
        datetime.fromtimestamp(float(since)).isoformat(sep=" ", timespec="seconds")
        if isinstance(since, (int, float))
        else "?"
    )
    return f"held by pid {owner.get('pid', '?')} on {owner.get('host', '?')} since {when}"


@contextlib.contextmanager
def build_lock(
    layout: CacheLayout,
    key: str,
    timeout: float,
    notify: Callable[[str], None],
) -> Iterator[float]:
    """Hold the key's lock; yields the seconds spent waiting for it."""
    path = layout.lock_path(key)
    lock = filelock.FileLock(str(path))
    start = time.monotonic()
    first_owner: list[Optional[JSONObject]] = []

    def waiting() -> None:
        first_owner.append(read_owner(layout, key))
        notify(
            f"waiting for build lock held by {describe_owner(first_owner[0])[len('held by ') :]} "
            f"(lock {path}; giving up after {timeout:.0f} s, see {ENV_LOCK_TIMEOUT})"
        )

    taken = take(lock, timeout, 0.1, waiting)
    if taken == "timeout":
        owner = read_owner(layout, key) or first_owner[0]
        message = (
            f"gave up after {timeout:.0f} s waiting for the build lock {path}, "
            f"{describe_owner(owner)}"
        )
        fix = (
            "that process is still building (the lock is released the moment it exits): "
            f"wait for it, stop it, or allow a longer wait with {ENV_LOCK_TIMEOUT}=SECONDS"
        )
        raise LockTimeout.failing("build.lock", message, fix, [path])
    # exactly 0 when nobody held it: callers tell "had to wait" by this
    waited = 0.0 if taken == "free" else max(time.monotonic() - start, 1e-6)
    owner_path = layout.owner_path(key)
    try:
        atomic_write_text(
            owner_path,
            json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}),
        )
        yield waited
    finally:
        # remove our record before letting the next holder in, so it never sees ours
        with contextlib.suppress(OSError):
            owner_path.unlink()
        lock.release()
