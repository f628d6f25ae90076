"""Peak resident memory of `convert` above the tool's own baseline, on a ~500 MB sharded
bf16 checkpoint (issue: "peaks well under its size").

    python bench/convert_memory.py [--layers N] [--shards N] [--keep DIR]

A tiny real-code-shaped checkpoint with bigger dimensions is generated (hidden 1024, MLP
2752, `--layers` 20 by default: about 500 MB in bf16, `--shards` 8), then converted in a
fresh child process without the verification child (which loads both models by design:
this measures the conversion itself, streaming plus the bit-for-bit comparison). The child
imports everything convert imports, reads its resident set (the baseline), converts, and
reports the peak: the kernel's high-water mark (VmHWM) and a 5 ms sampler of RssAnon
(memory the process allocated) and RssFile (pages of the memory-mapped shards, which the
kernel may drop at any time). Figures are MB (10^6 bytes) above the baseline.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent


def _status() -> dict[str, int]:
    out: dict[str, int] = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def child(src: Path, out: Path) -> None:
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401

    from qwen_kvprep.convert import run  # every import convert makes, before the baseline

    base = _status()
    peak = {"RssAnon": 0, "RssFile": 0, "VmRSS": 0}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            now = _status()
            for key in peak:
                peak[key] = max(peak[key], now[key])
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    result = run.convert(src, out, run.ConvertOptions(verify=False))
    wall = time.perf_counter() - t0
    done.set()
    sampler.join()
    end = _status()
    print(json.dumps({
        "baseline_rss": base["VmRSS"], "hwm_above": end["VmHWM"] - base["VmRSS"],
        "anon_above": peak["RssAnon"] - base["RssAnon"],
        "file_above": peak["RssFile"] - base["RssFile"],
        "rss_above": peak["VmRSS"] - base["VmRSS"], "wall_s": wall,
        "tensors": result.comparison.tensors, "bytes": result.comparison.bytes,
    }))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--keep", type=Path, help="generate the checkpoint here and keep it")
    parser.add_argument("--child", nargs=2, type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(*args.child)
        return 0
    from qwen_kvprep.tiny import generate_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.keep or Path(tmp) / "ckpt"
        if not (ckpt / "config.json").exists():
            generate_checkpoint(ckpt, layers=args.layers, heads=8, head_dim=128,
                                intermediate=5504, shards=args.shards, dtype="bf16")
        weights = [p for p in ckpt.iterdir() if p.suffix == ".safetensors"]
        size = sum(p.stat().st_size for p in weights)
        largest = max(p.stat().st_size for p in weights)
        res = subprocess.run(
            [sys.executable, __file__, "--child", str(ckpt), str(Path(tmp) / "out")],
            cwd=REPO, capture_output=True, text=True, check=True,
        )
        got = json.loads(res.stdout.strip().splitlines()[-1])
    mb = 1e6
    print(f"checkpoint: {size / mb:,.1f} MB in {len(weights)} shards "
          f"(largest {largest / mb:,.1f} MB)")
    print(f"converted and compared {got['tensors']} tensors ({got['bytes'] / mb:,.1f} MB) "
          f"in {got['wall_s']:.1f} s; baseline RSS {got['baseline_rss'] / mb:,.1f} MB")
    print(f"peak above baseline: VmHWM {got['hwm_above'] / mb:,.1f} MB "
          f"({got['hwm_above'] / size:.1%} of the checkpoint); sampled RssAnon "
          f"{got['anon_above'] / mb:,.1f} MB, RssFile {got['file_above'] / mb:,.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
