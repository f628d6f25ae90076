"""The plan itself: peak memory over a grid of batches and token counts, and the largest
batch and the longest context that fit, for both caches. Pure functions over ModelShape."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

from qwen_kvprep.jsontypes import JSONObject
from qwen_kvprep.planning.peak import MODES, ModelShape, Share, fits, predict_peak_bytes
from qwen_kvprep.planning.split import Split, split_model

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
    # the folder is not fixed yet: fast_path is what `fix` will install by default
    fast_path_pending: bool = False
    gpus: int = 1  # cards of gpu_memory_bytes each, the model split as device_map="auto" does
    leaf_margin: bool = True  # ... by transformers 5.18 or later (split.leaf_margin)


@dataclass(frozen=True)
class Row:
    batch: int
    tokens: int
    unquantized_bytes: int  # the fullest card's peak
    int8_bytes: int
    unquantized_oom: bool  # some card runs out (or the weights fit none)
    int8_oom: bool
    # with several cards: each card's peak, in card order
    unquantized_cards: tuple[int, ...] = ()
    int8_cards: tuple[int, ...] = ()

    def bytes_of(self, mode: str) -> int:
        return self.unquantized_bytes if mode == "unquantized" else self.int8_bytes

    def oom_of(self, mode: str) -> bool:
        return self.unquantized_oom if mode == "unquantized" else self.int8_oom

    def cards_of(self, mode: str) -> tuple[int, ...]:
        return self.unquantized_cards if mode == "unquantized" else self.int8_cards

    def to_json(self) -> JSONObject:
        """One row of `plan --json`'s table."""
        out: JSONObject = {
            "batch": self.batch,
            "tokens": self.tokens,
            "unquantized_bytes": self.unquantized_bytes,
            "int8_bytes": self.int8_bytes,
            "unquantized_oom": self.unquantized_oom,
            "int8_oom": self.int8_oom,
        }
        if len(self.unquantized_cards) > 1:
            out["unquantized_card_bytes"] = list(self.unquantized_cards)
            out["int8_card_bytes"] = list(self.int8_cards)
        return out


def _split(shape: ModelShape, scenario: Scenario) -> Split:
    return split_model(shape, scenario.gpu_memory_bytes, scenario.gpus, scenario.leaf_margin)


def _shares(shape: ModelShape, scenario: Scenario) -> tuple[Optional[Share], ...]:
    # one card: the whole model, the prediction as it always was
    return (None,) if scenario.gpus == 1 else _split(shape, scenario).shares


def card_peaks(
    shape: ModelShape, scenario: Scenario, mode: str, batch: int, tokens: int,
    shares: Optional[tuple[Optional[Share], ...]] = None,
) -> tuple[int, ...]:
    """Each card's peak bytes in a run ending with `tokens` cached tokens (the prompt
    included); one figure for one card."""
    if tokens < scenario.prompt_tokens:
        raise ValueError(f"tokens ({tokens}) < prompt tokens ({scenario.prompt_tokens})")
    return tuple(
        predict_peak_bytes(
            shape,
            batch,
            scenario.prompt_tokens,
            tokens - scenario.prompt_tokens,
            mode,
            scenario.prefill_chunk,
            softmax_in_fp32=scenario.softmax_in_fp32,
            fast_path=scenario.fast_path,
            share=share,
        )
        for share in (_shares(shape, scenario) if shares is None else shares)
    )


def peak(shape: ModelShape, scenario: Scenario, mode: str, batch: int, tokens: int) -> int:
    """Peak bytes of a run ending with `tokens` cached tokens (the prompt included), on
    the fullest card."""
    return max(card_peaks(shape, scenario, mode, batch, tokens))


def _short_card(
    shape: ModelShape, scenario: Scenario, mode: str, batch: int, tokens: int
) -> Optional[int]:
    """The first card that runs out in this run; None when it fits. A split that leaves
    weights for the CPU runs out on the last card, the one they did not fit."""
    if scenario.gpus > 1 and not _split(shape, scenario).holds_weights:
        return scenario.gpus - 1
    for card, bytes_ in enumerate(card_peaks(shape, scenario, mode, batch, tokens)):
        if not fits(bytes_, scenario.gpu_memory_bytes):
            return card
    return None


def _fits(shape: ModelShape, scenario: Scenario, mode: str, batch: int, tokens: int) -> bool:
    return _short_card(shape, scenario, mode, batch, tokens) is None


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


def first_short_card(
    shape: ModelShape, scenario: Scenario, mode: str, batch: int, tokens: int
) -> Optional[int]:
    """The card that runs out first as a search's answer is passed: at (batch, tokens)
    just beyond it; None when the search reached its bound (memory is not the limit)."""
    return _short_card(shape, scenario, mode, batch, tokens)


@dataclass(frozen=True)
class PlanResult:
    shape: ModelShape
    scenario: Scenario
    batches: tuple[int, ...]
    tokens: tuple[int, ...]
    rows: tuple[Row, ...]
    max_batch: dict[str, int]  # at tokens[0]
    max_tokens: dict[str, int]  # at batches[0]
    split: Split  # what each card holds (one card: the whole model)
    # the card that runs out first just past max_batch and max_tokens (None: not memory)
    max_batch_card: dict[str, Optional[int]]
    max_tokens_card: dict[str, Optional[int]]

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
    several = scenario.gpus > 1
    for b in batches:
        for t in tokens:
            u = card_peaks(shape, scenario, "unquantized", b, t)
            q = card_peaks(shape, scenario, "int8", b, t)
            rows.append(
                Row(
                    batch=b,
                    tokens=t,
                    unquantized_bytes=max(u),
                    int8_bytes=max(q),
                    unquantized_oom=not _fits(shape, scenario, "unquantized", b, t),
                    int8_oom=not _fits(shape, scenario, "int8", b, t),
                    unquantized_cards=u if several else (),
                    int8_cards=q if several else (),
                )
            )
    t0, b0 = tokens[0], batches[0]
    most_batch = {m: max_batch(shape, scenario, m, t0) for m in MODES}
    most_tokens = {m: max_tokens(shape, scenario, m, b0) for m in MODES}
    return PlanResult(
        shape=shape,
        scenario=scenario,
        batches=tuple(batches),
        tokens=tuple(tokens),
        rows=tuple(rows),
        max_batch=most_batch,
        max_tokens=most_tokens,
        split=_split(shape, scenario),
        max_batch_card={
            m: None if n >= MAX_BATCH_SEARCH else first_short_card(shape, scenario, m, n + 1, t0)
            for m, n in most_batch.items()
        },
        max_tokens_card={
            m: None if n >= MAX_TOKENS_SEARCH
            else first_short_card(shape, scenario, m, b0, max(n + 1, scenario.prompt_tokens))
            for m, n in most_tokens.items()
        },
    )
