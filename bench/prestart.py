"""How much a warm `qwen-kvprep prestart DIR -- true` costs, next to `python -c pass`.

    python bench/prestart.py [DIR] [--runs N] [--check]

Without DIR a tiny checkpoint is generated in a temporary folder and prepared with `fix`
(no smoke); the build comes from the build cache ($QWEN_KVPREP_CACHE or the default), so
only the first run ever compiles. Both commands are timed in the same run, interleaved, so
that load from other processes hits both alike. Prints the medians, the ratio, the targets
(median <= 100 ms and <= 8x python startup) and the top-level modules the fast path
imports. --check exits 1 when a target is missed or a heavy module is imported.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

TARGET_MS = 100.0
TARGET_RATIO = 8.0
HEAVY = ("torch", "transformers", "huggingface_hub", "click")


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(argv: list[str], env: dict[str, str], cpu: Optional[list[float]] = None) -> float:
    """Wall milliseconds of one run; its CPU milliseconds (user + system) go to `cpu`,
    which other processes' load distorts far less than wall time."""
    cpu_before = _children_cpu()
    start = time.perf_counter()
    res = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    elapsed = time.perf_counter() - start
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({res.returncode}): {res.stderr.decode()}")
    if cpu is not None:
        cpu.append((_children_cpu() - cpu_before) * 1000)
    return elapsed * 1000


def prestart_argv(directory: Path) -> list[str]:
    script = Path(sys.executable).with_name("qwen-kvprep")
    head = [str(script)] if script.exists() else [sys.executable, "-m", "qwen_kvprep"]
    return [*head, "prestart", str(directory), "--", "true"]


def prepare(directory: Optional[Path], work: Path, env: dict[str, str]) -> Path:
    if directory is None:
        from qwen_kvprep.tiny import generate_checkpoint

        directory = generate_checkpoint(work / "Bench-Chat")
        print(f"prepared a tiny checkpoint in {directory} (fix; the build may compile once)")
    res = subprocess.run(prestart_argv(directory)[:-2], env=env, text=True,
                         capture_output=True)
    if res.returncode != 0:
        raise SystemExit(f"prestart could not prepare {directory}:\n{res.stderr}")
    return directory


def fast_path_imports(directory: Path, env: dict[str, str], work: Path) -> tuple[str, list[str]]:
    dump = work / "imports.txt"
    res = subprocess.run(prestart_argv(directory), text=True, stderr=subprocess.PIPE,
                         env={**env, "QWEN_KVPREP_DEBUG_IMPORTS": str(dump)})
    top = sorted({m.split(".")[0] for m in dump.read_text().split()})
    return res.stderr.strip(), top


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", nargs="?", type=Path)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument("--keep-env", action="store_true",
                        help="keep PYTHONDONTWRITEBYTECODE if set (see below)")
    args = parser.parse_args()
    env = dict(os.environ)
    no_pyc = ""
    if env.get("PYTHONDONTWRITEBYTECODE") and not args.keep_env:
        # An installed wheel comes with .pyc files (pip compiles them); without cached
        # bytecode every start would also compile qwen_kvprep's modules, which is not
        # what a container pays.
        del env["PYTHONDONTWRITEBYTECODE"]
        no_pyc = " (PYTHONDONTWRITEBYTECODE dropped: bytecode cached as when installed)"
    with tempfile.TemporaryDirectory(prefix="kvprep-bench-") as tmp:
        work = Path(tmp)
        if args.directory is None:
            # a modules cache of our own, so the run leaves the user's untouched
            env.setdefault("HF_MODULES_CACHE", str(work / "modules"))
        directory = prepare(args.directory, work, env)
        said, top = fast_path_imports(directory, env, work)
        if "is ready" not in said:
            raise SystemExit(f"prestart did not take the fast path: {said}")
        base_argv = [sys.executable, "-c", "pass"]
        pre_argv = prestart_argv(directory)
        for _ in range(3):  # warm the page cache and .pyc files
            timed(base_argv, env)
            timed(pre_argv, env)
        base: list[float] = []
        pre: list[float] = []
        base_cpu: list[float] = []
        pre_cpu: list[float] = []
        for _ in range(args.runs):
            base.append(timed(base_argv, env, base_cpu))
            pre.append(timed(pre_argv, env, pre_cpu))

    med_base, med_pre = statistics.median(base), statistics.median(pre)
    ratio = med_pre / med_base
    heavy = [m for m in HEAVY if m in top]
    print(f"\nprestart fast path on {directory}  ({args.runs} interleaved runs, "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}){no_pyc}")
    print(f"{'command':<36} {'median ms':>10} {'p10':>7} {'p90':>7} {'cpu ms':>7}")
    for name, xs, cs in (("python -c pass", base, base_cpu),
                         ("qwen-kvprep prestart DIR -- true", pre, pre_cpu)):
        q = statistics.quantiles(xs, n=10)
        print(f"{name:<36} {statistics.median(xs):>10.1f} {q[0]:>7.1f} {q[-1]:>7.1f} "
              f"{statistics.median(cs):>7.1f}")
    ok_ms, ok_ratio = med_pre <= TARGET_MS, ratio <= TARGET_RATIO
    cpu_ratio = statistics.median(pre_cpu) / max(statistics.median(base_cpu), 1e-9)
    print(f"ratio prestart / python startup: {ratio:.2f}x wall, {cpu_ratio:.2f}x cpu")
    print(f"target median <= {TARGET_MS:.0f} ms: {'met' if ok_ms else 'MISSED'}; "
          f"<= {TARGET_RATIO:.0f}x python: {'met' if ok_ratio else 'MISSED'}")
    print(f"top-level modules imported on the fast path ({len(top)}): {' '.join(top)}")
    print(f"heavy modules imported: {', '.join(heavy) if heavy else 'none'}")
    return 0 if (ok_ms and ok_ratio and not heavy) or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())
