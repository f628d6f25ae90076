"""How many compile jobs to run at once: bounded by CPUs and by the container's memory.

An nvcc job compiling against torch headers peaks around 1.5 GB; ninja's default (CPUs+2)
gets containers with a small memory limit OOM-killed half-way through a build, which
then looks like a compiler crash. MAX_JOBS overrides (torch's ninja reads it too).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

BYTES_PER_JOB = 1536 * 1024 * 1024
_UNLIMITED = 1 << 60  # cgroup v1 reports "no limit" as a huge number


def _read_int(path: Path) -> Optional[int]:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max" or not text.isdigit():
        return None
    value = int(text)
    return value if value < _UNLIMITED else None


def _own_cgroup_paths() -> list[tuple[str, str]]:
    """(controllers, path) pairs from /proc/self/cgroup."""
    out: list[tuple[str, str]] = []
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            parts = line.split(":", 2)
            if len(parts) == 3:
                out.append((parts[1], parts[2]))
    except OSError:
        pass
    return out


def cgroup_memory_limit(root: Path = Path("/sys/fs/cgroup")) -> Optional[int]:
    """The tightest memory limit of this process's cgroup (v2 or v1), None when unlimited."""
    candidates: list[Path] = []
    for controllers, path in _own_cgroup_paths():
        rel = path.lstrip("/")
        if controllers == "":  # v2 unified hierarchy: the limit may sit on any ancestor
            node = root / rel
            while True:
                candidates.append(node / "memory.max")
                if node == root or root not in node.parents:
                    break
                node = node.parent
        elif "memory" in controllers.split(","):
            candidates += [root / "memory" / rel / "memory.limit_in_bytes"]
    # Inside a container the own cgroup is usually mounted as the root itself.
    candidates += [root / "memory.max", root / "memory" / "memory.limit_in_bytes"]
    limits = [v for v in (_read_int(p) for p in candidates) if v is not None]
    return min(limits) if limits else None


def _mem_available() -> Optional[int]:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def compile_jobs() -> tuple[int, str]:
    """The job count and why (shown in the build finding)."""
    env = os.environ.get("MAX_JOBS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env), f"MAX_JOBS={env}"
    cpus = _cpus()
    memory = [m for m in (cgroup_memory_limit(), _mem_available()) if m is not None]
    if not memory:
        return cpus, f"{cpus} CPU(s)"
    budget = min(memory)
    by_memory = max(1, budget // BYTES_PER_JOB)
    jobs = max(1, min(cpus, by_memory))
    return jobs, f"{cpus} CPU(s), {budget / 2**30:.1f} GiB memory at ~1.5 GiB a job"
