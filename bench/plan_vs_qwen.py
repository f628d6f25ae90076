"""`qwen-kvprep plan` against Qwen's published memory table for Qwen-7B (bf16, A100-80G).

    python bench/plan_vs_qwen.py [--write]

Predicts every entry of Qwen's two tables from the config-only Qwen-7B-Chat checkout in
tests/data (no weights, no GPU) with plan's defaults -- a one-token prompt, then
generation until the token count is cached, as Qwen's profiling did -- and prints a
Markdown section: each entry with its relative error, the mean absolute error, and whether
OOM falls where Qwen saw it on an 80 GiB card. --write puts that section into
bench/RESULTS.md (replacing an earlier one).

Qwen's figures are "GB" printed from torch.cuda.max_memory_allocated() / 1024**3, i.e.
GiB; the errors under the decimal reading (10^9 bytes) are shown too. Nothing here is
fitted: plan's constants are the ones in qwen_kvprep/planning/peak.py.
"""

from __future__ import annotations

import argparse
import re
import statistics
from pathlib import Path
from typing import Optional

from qwen_kvprep.commands.plan import DEFAULT_PROMPT_TOKENS
from qwen_kvprep.planning.capacity import Scenario, max_batch, peak
from qwen_kvprep.planning.model import model_shape
from qwen_kvprep.planning.peak import CUDA_CONTEXT_BYTES, ModelShape, fits

ROOT = Path(__file__).resolve().parent.parent
CHECKOUT = ROOT / "tests" / "data" / "qwen-7b-chat-config"
RESULTS = ROOT / "bench" / "RESULTS.md"
TITLE = "## Plan vs Qwen's published table"
GIB = 1024**3
CARD = 80 * GIB  # A100-80G

# Qwen's published peak memory, Qwen-7B bf16 on an A100-80G; None = OOM.
BY_BATCH_TOKENS = 1024
BY_BATCH = {
    "unquantized": {1: 16.3, 4: 24.1, 16: 31.7, 32: 48.7, 64: None, 100: None},
    "int8": {1: 15.5, 4: 17.2, 16: 22.3, 32: 30.2, 64: 48.2, 100: 72.4},
}
BY_TOKENS_BATCH = 1
BY_TOKENS = {
    "unquantized": {512: 15.2, 1024: 16.3, 2048: 17.6, 4096: 19.5, 8192: 23.2},
    "int8": {512: 15.0, 1024: 15.5, 2048: 15.8, 4096: 16.6, 8192: 17.6},
}
LABEL = {"unquantized": "unquantized", "int8": "Int8"}


def _pct(x: float) -> str:
    return f"{x:+.1f}%"


def section() -> str:
    shape = model_shape(CHECKOUT)
    scenario = Scenario(
        prompt_tokens=DEFAULT_PROMPT_TOKENS, prefill_chunk=None, gpu_memory_bytes=CARD
    )
    rows: list[str] = []
    errors_gib: list[float] = []
    errors_gb: list[float] = []
    oom_mismatch: list[str] = []
    worst: tuple[float, str] = (0.0, "")

    def entry(table: str, mode: str, batch: int, tokens: int, qwen: Optional[float]) -> None:
        nonlocal worst
        got = peak(shape, scenario, mode, batch, tokens)
        ours_oom = not fits(got, CARD)
        shown = f"{got / GIB:.2f}" + (" (OOM)" if ours_oom else "")
        key = f"{table} {batch if table == 'batch' else tokens}, {LABEL[mode]}"
        if qwen is None or ours_oom:
            match = "yes" if (qwen is None) == ours_oom else "**no**"
            if match != "yes":
                oom_mismatch.append(key)
            need = (got + CUDA_CONTEXT_BYTES) / GIB
            rows.append(
                f"| {key} | {'OOM' if qwen is None else qwen} | {shown} | needs {need:.2f} of "
                f"80 GiB | | OOM as Qwen: {match} |"
            )
            return
        err = 100 * (got / GIB - qwen) / qwen
        err_gb = 100 * (got - qwen * 1e9) / (qwen * 1e9)
        errors_gib.append(abs(err))
        errors_gb.append(abs(err_gb))
        worst = max(worst, (abs(err), f"{key}: {_pct(err)}"))
        rows.append(f"| {key} | {qwen} | {shown} | {_pct(err)} | {_pct(err_gb)} | |")

    for mode, values in BY_BATCH.items():
        for batch, qwen in values.items():
            entry("batch", mode, batch, BY_BATCH_TOKENS, qwen)
    for mode, values in BY_TOKENS.items():
        for tokens, qwen in values.items():
            entry("tokens", mode, BY_TOKENS_BATCH, tokens, qwen)

    within = sum(e <= 20 for e in errors_gib)
    mb = {m: max_batch(shape, scenario, m, BY_BATCH_TOKENS) for m in ("unquantized", "int8")}
    lines = [
        TITLE,
        "",
        "Written by `python bench/plan_vs_qwen.py --write` (no GPU, no weights: the config-only",
        "checkout in `tests/data/qwen-7b-chat-config`). Qwen-7B bf16 on an A100-80G, peak",
        f"memory; plan's defaults: a {DEFAULT_PROMPT_TOKENS}-token prompt, then greedy decoding "
        "until the",
        "token count is cached; an entry is OOM when plan's peak plus "
        f"{CUDA_CONTEXT_BYTES / GIB:.1f} GiB of CUDA context",
        "exceeds 80 GiB. Error = (plan − Qwen) / Qwen with Qwen's figures read as GiB (its",
        'profiling printed `max_memory_allocated() / 1024**3` as "GB"), and as 10^9 bytes.',
        "Rows are `table key, cache`: `batch N` at 1,024 tokens, `tokens N` at batch 1.",
        "",
        "| entry | Qwen | plan (GiB) | error (GiB) | error (GB) | |",
        "|---|---:|---:|---:|---:|---|",
        *rows,
        "",
        f"- mean absolute error: **{statistics.mean(errors_gib):.1f}%** reading Qwen's figures "
        f"as GiB, {statistics.mean(errors_gb):.1f}% as GB (GiB matches better"
        if statistics.mean(errors_gib) <= statistics.mean(errors_gb)
        else f"- mean absolute error: **{statistics.mean(errors_gib):.1f}%** reading Qwen's "
        f"figures as GiB, {statistics.mean(errors_gb):.1f}% as GB (GB matches better",
    ]
    lines[-1] += (
        f"); {within} of {len(errors_gib)} numeric entries within 20%; largest: {worst[1]}."
    )
    lines.append(
        "- OOM where Qwen saw it: "
        + (
            "yes, every entry."
            if not oom_mismatch
            else "**no** for " + "; ".join(oom_mismatch) + "."
        )
    )
    lines.append(
        f"- largest batch at 1,024 tokens on 80 GiB: {mb['unquantized']} unquantized, "
        f"{mb['int8']} with the Int8 cache."
    )
    lines += ["", *reading(shape, scenario)]
    return "\n".join(lines) + "\n"


def reading(shape: ModelShape, scenario: Scenario) -> list[str]:
    """Where plan and Qwen part, and why; the numbers are computed, the reasons argued."""
    need64 = (peak(shape, scenario, "unquantized", 64, 1024) + CUDA_CONTEXT_BYTES) / GIB
    q = BY_BATCH["unquantized"]
    slope = [
        (b0, b1, ((q[b1] or 0) - (q[b0] or 0)) / (b1 - b0))
        for b0, b1 in ((1, 4), (4, 16), (16, 32))
    ]
    slopes = ", ".join(f"{a}→{b}: {v:.2f} GiB" for a, b, v in slope)
    return [
        "Where plan and Qwen part:",
        "",
        "- **batch 4, unquantized.** Qwen's unquantized row is not affine in the batch: per "
        f"added sequence it grows {slopes}. One 1,024-token sequence caches 0.5 GiB and a "
        "decode step holds the old and the new cache, 1.0 GiB, which is plan's slope and "
        "Qwen's 16→32 step. No allocation proportional to the batch gives 2.6 GiB per "
        "sequence between 1 and 4 and 0.63 between 4 and 16, so the 24.1 holds something the "
        "remote code's allocations do not explain; plan is not bent to it.",
        f"- **batch 64, unquantized.** plan needs {need64:.2f} GiB (peak + CUDA context) of 80: "
        f"{80 - need64:.2f} GiB to spare, {100 * (80 - need64) / 80:.1f}% of the card. Qwen saw "
        "OOM. Three things plan leaves out close that gap, none of them part of the run plan "
        'predicts: (1) torch sees less than 80 GiB on an "80 GB" A100 -- PyTorch\'s own '
        "out-of-memory messages on A100/A800-80GB report 79.1-79.3 GiB of total capacity, which "
        "is what plan's default `--gpu-memory` reads on such a card "
        f"(margin {79.1 - need64:.2f}-{79.3 - need64:.2f} GiB); (2) Qwen generated with "
        "`generate` and top-p sampling, which sorts the [64, 151936] logits with int64 indices "
        "while both caches are alive (roughly 0.1-0.3 GiB); (3) the caching allocator's "
        "fragmentation, which plan does not model. A prediction this close to the card's "
        "size is a coin toss; plan reports the number, it does not bend it.",
        "- **Int8 by tokens.** Qwen's Int8 row grows by about one Int8 cache of the added "
        "tokens (1.0 GiB from 4,096 to 8,192 tokens; 4,096 tokens cache 1.03 GiB), its "
        "unquantized row by about two. The remote code concatenates the quantized tuples with "
        "`torch.cat` while the caller still holds the old ones, exactly as it does "
        "unquantized, so plan predicts two in both modes (+5.5% at 8,192).",
        "- The derivation itself is checked where it can be without a GPU: "
        "`tests/test_plan.py` measures the live tensor bytes (what the CUDA allocator counts) "
        "of the same run on the tiny model's remote code on CPU, prefill, chunks and decode, "
        "both caches: plan is within 5% beyond the weights, the largest gap being the rotary "
        "tables, which plan bounds from above.",
    ]


def write(text: str) -> None:
    old = RESULTS.read_text(encoding="utf-8") if RESULTS.exists() else "# Benchmark results\n"
    # replace from our title to the next "## " heading (or the end)
    pattern = re.compile(re.escape(TITLE) + r".*?(?=^## |\Z)", re.DOTALL | re.MULTILINE)
    if pattern.search(old):
        new = pattern.sub(lambda _: text + "\n", old, count=1)
    else:
        new = old.rstrip("\n") + "\n\n" + text
    RESULTS.write_text(new.rstrip("\n") + "\n", encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="update bench/RESULTS.md")
    args = parser.parse_args()
    text = section()
    print(text)
    if args.write:
        write(text)


if __name__ == "__main__":
    main()
