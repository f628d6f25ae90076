"""K and V measured per layer on a calibration text, block by block over OUT.

OUT's Qwen2ForCausalLM is built as the proof's skeleton of one block (blockproof.Side):
the embedding is read, each row of the calibration text is run to the first block, then
each block's weights are read, the block runs on every row's hidden states, and the
weights are dropped. Resident: one block (widened to float32), the embedding while it is
used, the activations of one row: the 7B shape stays within a few GiB.

What is recorded: the keys and values exactly as the attention hands them to its cache,
K after rotary, through a stand-in cache object given to the block in place of the
model's (None in the proof's pass): its `update` notes the largest |K| and |V| and gives
them back untouched, so the block computes what it computes without a cache.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from qwen_kvprep.convert.blockproof import Side, converted_side

if TYPE_CHECKING:
    import torch


# the keyword a decoder block's cache goes by: past_key_values from 4.56, past_key_value
# before, cache from 5.24 (past_key_values deprecated there)
_CACHE_KWARGS = ("past_key_values", "past_key_value", "cache")


@dataclass(frozen=True)
class KVAbsmax:
    """The largest |K| (after rotary) and |V| of each layer over `tokens` tokens."""

    k: tuple[float, ...]
    v: tuple[float, ...]
    tokens: int


class Recorder:
    """Stands in for the cache of the block being run (module doc)."""

    def __init__(self) -> None:
        self.k = 0.0
        self.v = 0.0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object,
               **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = max(self.k, float(key_states.detach().abs().max()))
        self.v = max(self.v, float(value_states.detach().abs().max()))
        return key_states, value_states

    # what older attention code asks a cache before it stores (nothing is stored here)
    def get_seq_length(self, *args: object, **kwargs: object) -> int:
        return 0

    def get_usable_length(self, *args: object, **kwargs: object) -> int:
        return 0


def with_recorder(side: Side, recorder: Optional[Recorder], rows: range) -> None:
    """Give `recorder` to the block as its cache on the calls of `rows` (None: take it
    back)."""
    accepted = inspect.signature(side.block.forward).parameters
    for r in rows:
        args, kwargs = side.calls[r]
        # the model passes its cache on where it has one; without use_cache, newer releases
        # (5.24) leave the keyword out, and the block's own signature names it
        key = next((k for k in _CACHE_KWARGS if k in kwargs), None) or next(
            (k for k in _CACHE_KWARGS if k in accepted), None)
        if key is None:
            raise RuntimeError(
                "this transformers' Qwen2 block takes no cache keyword: K and V cannot be "
                "read as the attention stores them")
        side.calls[r] = (args, {**kwargs, key: recorder})


def run_blocks(side: Side, hidden: list[torch.Tensor], rows: range, layers: int,
               on_block: Optional[Callable[[int, int], None]] = None) -> KVAbsmax:
    """Run every block of `side` on `hidden`, recording K and V on `rows` of it."""
    k: list[float] = []
    v: list[float] = []
    for i in range(layers):
        recorder = Recorder()
        with_recorder(side, recorder, rows)
        hidden = side.run_block(side.files.read(side.block_names(i)), i, hidden)
        with_recorder(side, None, rows)
        k.append(recorder.k)
        v.append(recorder.v)
        if on_block is not None:
            on_block(i + 1, layers)
    tokens = sum(int(hidden[r].shape[-2]) for r in rows)
    return KVAbsmax(tuple(k), tuple(v), tokens)


def measure(out: Path, rows: list[list[int]], *, layers: int,
            on_block: Optional[Callable[[int, int], None]] = None) -> KVAbsmax:
    """The K and V absmax of each of OUT's `layers` layers over the token `rows`."""
    import torch

    side = converted_side(out, torch.float32, layers)
    batch = [torch.tensor([r]) for r in rows if r]
    hidden = side.start(batch)
    return run_blocks(side, hidden, range(len(batch)), layers, on_block)


__all__ = ["KVAbsmax", "Recorder", "measure", "run_blocks"]
