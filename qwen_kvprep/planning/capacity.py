"""The plan itself: peak memory over a grid of batches and token counts, and the largest
batch and the longest context that fit, for both caches. Pure functions over ModelShape."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

from qwen_kvprep.jsontypes import JSONObject
from qwen_kvprep.planning.peak import MODES, ModelShape, fits, predict_peak_bytes

# Searches stop here: far beyond any GPU, so hitting the bound means "memory is not the
# limit" rather than an answer.
MAX_BATCH_SEARCH = 1 << 24
MAX_TOKENS_SEARCH = 1 << 34


@dataclass(frozen=True)
class Scenario:
    """How each run generates, and the memory it must fit in."""

    prompt_tokens: int
    prefill_chunk: Optional[int]
    gpu_memory_bytes: int
    softmax_in_fp32: bool = False
    fast_path: bool = False  # the Int8 cache runs through qwen-kvprep's fast path


@dataclass(frozen=True)
class Row:
    batch: int
    tokens: int
    unquantized_bytes: int
    int8_bytes: int
    unquantized_oom: bool
    int8_oom: bool

    def bytes_of(self, mode: str) -> int:
        return self.unquantized_bytes if mode == "unquantized" else self.int8_bytes

    def oom_of(self, mode: str) -> bool:
        return self.unquantized_oom if mode == "unquantized" else self.int8_oom

    def to_json(self) -> JSONObject:
        """One row of `plan --json`'s table."""
        return {
            "batch": self.batch,
            "tokens": self.tokens,
            "unquantized_bytes": self.unquantized_bytes,
            "int8_bytes": self.int8_bytes,
            "unquantized_oom": self.unquantized_oom,
            "int8_oom": self.int8_oom,
        }


def peak(shape: ModelShape, scenario: Scenario, mode: str, batch: int, tokens: int) -> int:
    """Peak bytes of a run ending with `tokens` cached tokens (the prompt included)."""
    if tokens < scenario.prompt_tokens:
        raise ValueError(f"tokens ({tokens}) < prompt tokens ({scenario.prompt_tokens})")
    return predict_peak_bytes(
        shape,
        batch,
        scenario.prompt_tokens,
        tokens - scenario.prompt_tokens,
        mode,
        scenario.prefill_chunk,
        softmax_in_fp32=scenario.softmax_in_fp32,
        fast_path=scenario.fast_path,
    )


def _fits(shape: ModelShape, scenario: Scenario, mode: str, batch: int, tokens: int) -> bool:
    return fits(peak(shape, scenario, mode, batch, tokens), scenario.gpu_memory_bytes)


def _largest(lo: int, limit: int, ok: Callable[[int], bool]) -> int:
    """Largest n in [lo, limit] with ok(n), given ok(lo) and ok monotone (true, then false)."""
    hi = lo
    # gallop up, then bisect: a few dozen evaluations of a closed-form prediction
    while hi < limit and ok(min(hi * 2, limit)):
        hi = min(hi * 2, limit)
    if hi == limit:
        return hi
    bad = min(hi * 2, limit)
    while bad - hi > 1:
        mid = (hi + bad) // 2
        if ok(mid):
            hi = mid
        else:
            bad = mid
    return hi


def max_batch(shape: ModelShape, scenario: Scenario, mode: str, tokens: int) -> int:
    """The largest batch that fits with `tokens` cached tokens; 0 when not even one does."""
    if not _fits(shape, scenario, mode, 1, tokens):
        return 0
    return _largest(1, MAX_BATCH_SEARCH, lambda b: _fits(shape, scenario, mode, b, tokens))


def max_tokens(shape: ModelShape, scenario: Scenario, mode: str, batch: int) -> int:
    """The most cached tokens (prompt included) that fit at `batch`; 0 when not even the
    prompt does. Memory only: the model's own context limit is not applied here."""
    start = scenario.prompt_tokens
    if not _fits(shape, scenario, mode, batch, start):
        return 0
    return _largest(start, MAX_TOKENS_SEARCH, lambda t: _fits(shape, scenario, mode, batch, t))


@dataclass(frozen=True)
class PlanResult:
    shape: ModelShape
    scenario: Scenario
    batches: tuple[int, ...]
    tokens: tuple[int, ...]
    rows: tuple[Row, ...]
    max_batch: dict[str, int]  # at tokens[0]
    max_tokens: dict[str, int]  # at batches[0]

    def row(self, batch: int, tokens: int) -> Row:
        for r in self.rows:
            if r.batch == batch and r.tokens == tokens:
                return r
        raise KeyError((batch, tokens))


def make_plan(
    shape: ModelShape, scenario: Scenario, batches: Sequence[int], tokens: Sequence[int]
) -> PlanResult:
    if not batches or not tokens:
        raise ValueError("batches and tokens must not be empty")
    rows = []
    for b in batches:
        for t in tokens:
            u = peak(shape, scenario, "unquantized", b, t)
            q = peak(shape, scenario, "int8", b, t)
            rows.append(
                Row(
                    batch=b,
                    tokens=t,
                    unquantized_bytes=u,
                    int8_bytes=q,
                    unquantized_oom=not fits(u, scenario.gpu_memory_bytes),
                    int8_oom=not fits(q, scenario.gpu_memory_bytes),
                )
            )
    return PlanResult(
        shape=shape,
        scenario=scenario,
        batches=tuple(batches),
        tokens=tuple(tokens),
        rows=tuple(rows),
        max_batch={m: max_batch(shape, scenario, m, tokens[0]) for m in MODES},
        max_tokens={m: max_tokens(shape, scenario, m, batches[0]) for m in MODES},
    )
