"""`convert` at a real Qwen shape, beside `cp -r` of the same folder, in one run.

    python bench/convert_scale.py --shape 7b --work DIR [--rounds 1] [--keep] [--kv-cache]

A checkpoint of the shape's real dimensions (Qwen-1.8B, 7B or 14B: hidden size, layers,
heads, MLP width, vocabulary; 8 safetensors shards of random bf16 weights, std 0.02,
windows of one pool of 64 Mi random values) is
written into DIR with the tiny checkpoint's tokenizer, generation config and stand-in
remote code (Qwen's own modeling_qwen.py is not in the repository). Then, alternately,
each round:

- `cp -r SRC COPY` and `cp -r SRC COPY && sync` (convert fsyncs what it writes; cp does
  not, so both are shown);
- `qwen-kvprep convert SRC OUT --no-verify`;
- `qwen-kvprep convert SRC OUT` (the default: the proof, every layer);
- with --kv-cache, `qwen-kvprep convert SRC OUT --no-verify --kv-cache fp8` (the conversion
  and the calibration pass of fp8 KV scales, block by block);

each in a fresh process (after `sync`, and with --drop-caches an empty page cache, so
that no run reads what the one before left in memory), timed, with its peak resident set
(wait4's ru_maxrss: the largest of the process and the children it waited for, so the
proof's child is in it) and the longest silence between two of its stderr lines. The
proof's coverage is read from convert's --json document. Everything written under DIR
is deleted at the end (--keep keeps the source checkpoint). Figures print as JSON lines
and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent

# (hidden, layers, heads, MLP width of w1/w2, vocabulary)
SHAPES = {
    "1.8b": (2048, 24, 16, 5504, 151936),
    "7b": (4096, 32, 32, 11008, 151936),
    "14b": (5120, 40, 40, 13696, 152064),
}


def tensors(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    hidden, layers, _heads, mlp, vocab = SHAPES[shape]
    out: list[tuple[str, tuple[int, ...]]] = [("transformer.wte.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"transformer.h.{i}."
        out += [
            (p + "ln_1.weight", (hidden,)),
            (p + "attn.c_attn.weight", (3 * hidden, hidden)),
            (p + "attn.c_attn.bias", (3 * hidden,)),
            (p + "attn.c_proj.weight", (hidden, hidden)),
            (p + "ln_2.weight", (hidden,)),
            (p + "mlp.w1.weight", (mlp, hidden)),
            (p + "mlp.w2.weight", (mlp, hidden)),
            (p + "mlp.c_proj.weight", (hidden, mlp)),
        ]
    out += [("transformer.ln_f.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    return out


_POOL = 64 << 20


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _write_shard(path: Path, group: list[tuple[str, tuple[int, ...]]], seed: int) -> None:
    """A safetensors file written tensor by tensor (the whole model never in memory)."""
    import torch

    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in group:
        n = _numel(shape) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(len(raw) + 8) % 8)
    # drawing 7.7 billion normals takes a shared 2-core machine half an hour: each tensor
    # is a window of one pool of 64 Mi random values, at an offset of its own
    gen = torch.Generator().manual_seed(seed)
    pool = (torch.randn(_POOL, generator=gen) * 0.02).to(torch.bfloat16)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        for k, (name, shape) in enumerate(group):
            if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
                fh.write(torch.ones(shape, dtype=torch.bfloat16).view(torch.uint8).numpy())
                continue
            n, at = _numel(shape), (k * 7919) % _POOL
            while n:
                take = min(n, _POOL - at)
                fh.write(pool[at:at + take].view(torch.uint8).numpy())
                n -= take
                at = 0


def generate(shape: str, dest: Path, shards: int = 8) -> int:
    """The checkpoint in `dest`; its weights' size in bytes."""
    from qwen_kvprep.tiny import generate_checkpoint

    hidden, layers, heads, mlp, vocab = SHAPES[shape]
    generate_checkpoint(dest, layers=1, shards=1, dtype="bf16")
    (dest / "model.safetensors").unlink()
    config = json.loads((dest / "config.json").read_text())
    config.update(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  intermediate_size=2 * mlp, vocab_size=vocab, kv_channels=hidden // heads,
                  no_bias=True)
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    names = tensors(shape)
    total = sum(_numel(s) * 2 for _, s in names)
    per = total / shards
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, s in names:
        if size >= per * len(groups) and len(groups) < shards:
            groups.append([])
        groups[-1].append((name, s))
        size += _numel(s) * 2
    files = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map = {}
    for i, (fname, group) in enumerate(zip(files, groups)):
        _write_shard(dest / fname, group, seed=i)
        weight_map.update({name: fname for name, _ in group})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (dest / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total


def measure(argv: list[str], *, json_out: bool = False) -> dict[str, object]:
    """Wall time, peak RSS (this process and the children it waited for), the longest
    gap between stderr lines, and stdout."""
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    gaps = [0.0]
    lines: list[str] = []

    def read_err() -> None:
        last = t0
        assert proc.stderr is not None
        for line in proc.stderr:
            now = time.monotonic()
            gaps.append(now - last)
            last = now
            lines.append(line.rstrip("\n"))
        gaps.append(time.monotonic() - last)

    reader = threading.Thread(target=read_err)
    reader.start()
    assert proc.stdout is not None
    stdout = proc.stdout.read()
    _pid, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - t0
    reader.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {
        "argv": " ".join(Path(a).name if "/" in a else a for a in argv),
        "rc": proc.returncode, "wall_s": round(wall, 1),
        "user_s": round(usage.ru_utime, 1), "sys_s": round(usage.ru_stime, 1),
        "peak_rss_gb": round(usage.ru_maxrss * 1024 / 1e9, 2),
        "longest_silence_s": round(max(gaps), 1),
        "stdout": stdout if json_out else stdout[-2000:], "stderr_tail": lines[-8:],
        "stderr": lines,
    }


def _rm(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="1.8b")
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--keep", action="store_true", help="keep the generated checkpoint")
    p.add_argument("--source", type=Path, help="an existing generated checkpoint")
    p.add_argument("--no-default", action="store_true",
                   help="leave out the default convert (the proof)")
    p.add_argument("--no-no-verify", action="store_true",
                   help="leave out convert --no-verify")
    p.add_argument("--logs", type=Path, help="write each run's stderr here")
    p.add_argument("--drop-caches", action="store_true",
                   help="empty the page cache before each run (root): every run then reads "
                        "the source from the disk, as a first convert of a download does")
    p.add_argument("--kv-cache", action="store_true",
                   help="also `convert --no-verify --kv-cache fp8` (the calibration pass)")
    p.add_argument("--generate-only", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.generate_only is not None:
        print(generate(args.shape, args.generate_only))
        return 0
    cli = str(Path(sys.executable).parent / "qwen-kvprep")
    work = args.work.absolute()
    work.mkdir(parents=True, exist_ok=True)
    src = args.source or work / f"Qwen-{args.shape}-shape"
    out, copy = work / "out", work / "copy"
    rows: list[dict[str, object]] = []
    try:
        if args.source is None:
            t = time.monotonic()
            # in a process of its own: a child forked from a parent holding torch would
            # start with the parent's resident set in its ru_maxrss
            size = int(subprocess.run(
                [sys.executable, __file__, "--shape", args.shape, "--work", str(work),
                 "--generate-only", str(src)], check=True, capture_output=True, text=True,
            ).stdout.split()[-1])
            print(json.dumps({"generated": str(src), "bytes": size,
                              "s": round(time.monotonic() - t, 1)}), flush=True)
        subprocess.run(["sync"], check=True)
        for r in range(args.rounds):
            runs = [
                ("cp -r", ["cp", "-r", str(src), str(copy)], copy),
                ("cp -r && sync", ["sh", "-c", f'cp -r "{src}" "{copy}" && sync'], copy),
                ("convert --no-verify", [cli, "convert", str(src), str(out), "--no-verify"], out),
                ("convert", [cli, "convert", str(src), str(out), "--json"], out),
            ]
            if args.kv_cache:
                runs.append(("convert --no-verify --kv-cache fp8",
                             [cli, "convert", str(src), str(out), "--no-verify", "--kv-cache",
                              "fp8"], out))
                # the proof and then the calibration pass, as a user's default run does
                runs.append(("convert --kv-cache fp8",
                             [cli, "convert", str(src), str(out), "--json", "--kv-cache",
                              "fp8"], out))
            for label, cmd, target in runs:
                if (args.no_default and label.startswith("convert") and "--no-verify" not in
                        label) or (args.no_no_verify and label == "convert --no-verify"):
                    continue
                _rm(target)
                subprocess.run(["sync"], check=True)
                if args.drop_caches:
                    Path("/proc/sys/vm/drop_caches").write_text("3\n")
                row = measure(cmd, json_out="--json" in cmd)
                row["what"], row["round"] = label, r + 1
                if args.logs is not None:
                    args.logs.mkdir(parents=True, exist_ok=True)
                    log = args.logs / f"{label.replace(' ', '_')}-{r + 1}.log"
                    log.write_text("\n".join(row.pop("stderr")) + "\n")
                else:
                    row.pop("stderr")
                if "--json" in cmd and row["rc"] == 0:
                    doc = json.loads(str(row["stdout"]))
                    verify = doc.get("verify") or {}
                    measured = verify.get("measured") or {}
                    row["proof"] = {
                        "ok": verify.get("ok"), "fit": measured.get("fit"),
                        "blocks": len(measured.get("blocks", [])),
                        "greedy_skipped": measured.get("greedy_skipped"),
                        "seconds": measured.get("seconds"),
                        "lines": verify.get("lines"),
                    }
                row.pop("stdout")
                rows.append(row)
                print(json.dumps(row), flush=True)
                _rm(target)
    finally:
        _rm(out)
        _rm(copy)
        if not args.keep and args.source is None:
            _rm(src)
    print(f"{'what':36} {'wall s':>7} {'user s':>7} {'sys s':>6} {'peak GB':>8} {'silence s':>9}")
    for row in rows:
        print(f"{row['what']:36} {row['wall_s']:>7} {row['user_s']:>7} {row['sys_s']:>6} "
              f"{row['peak_rss_gb']:>8} {row['longest_silence_s']:>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
