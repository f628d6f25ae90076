"""How transformers' `device_map="auto"` spreads a Qwen (v1) model over several GPUs of
one size, as a pure function of its shape.

transformers reads "auto" as "balanced" (`_get_device_map`): `get_balanced_memory` first
lowers every card's budget but the last to

    total weights // N + int(1.25 * max(largest decoder block, largest leaf module))

(from transformers 5.18; the largest leaf of a Qwen model is wte or lm_head, vocab x
hidden. transformers 5.0 to 5.17, and accelerate's version that 4.x uses, take the mean of
the leaf modules instead of the largest, which for every Qwen shape is below one block: a
margin of 1.25 x the block, so the first cards can hold a block fewer), then
`infer_auto_device_map` walks the modules in order -- wte, the blocks h.0 ... h.L-1
(QWenBlock is in `_no_split_modules`: never cut), ln_f, lm_head -- and puts each on the
current card while it fits, else moves on to the next
card and never back. On the first card it keeps the largest module still to be placed
free (room to bring back a module offloaded to the CPU). What fits no card would be
offloaded to the CPU: plan counts that as not fitting.

A card's budget starts as the memory accelerate finds free on it (`torch.cuda.
mem_get_info`): the card less the CUDA context. Buffers (the rotary inv_freq, a few
hundred bytes) are not placed. Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

from qwen_kvprep.planning.peak import CUDA_CONTEXT_BYTES, ModelShape, Share

# Beyond what any one machine holds: `--gpus` stops here and so does the search for the
# fewest cards that hold the weights.
MAX_GPUS = 64


@dataclass(frozen=True)
class Module:
    """One module accelerate places whole."""

    name: str  # as plan prints it: wte, h.0 ... h.79, ln_f, lm_head
    bytes: int
    layer: int = -1  # the decoder block's index; -1 for the others


@dataclass(frozen=True)
class CardLoad:
    """What one card holds after the split."""

    index: int
    budget_bytes: int  # the max_memory accelerate fills it to (its free memory for the last)
    modules: tuple[Module, ...]

    @property
    def weights_bytes(self) -> int:
        return sum(m.bytes for m in self.modules)

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(m.layer for m in self.modules if m.layer >= 0)

    @property
    def share(self) -> Share:
        names = {m.name for m in self.modules}
        return Share(self.weights_bytes, len(self.layers), first="wte" in names,
                     head="lm_head" in names)

    def holds(self) -> str:
        """"wte, layers 0-39 (40)", "layers 40-79 (40), ln_f, lm_head", "nothing"."""
        parts = [m.name for m in self.modules if m.layer < 0 and m.name in ("wte",)]
        layers = self.layers
        if layers:
            span = f"layer {layers[0]}" if len(layers) == 1 else (
                f"layers {layers[0]}-{layers[-1]}")
            parts.append(f"{span} ({len(layers)})")
        parts += [m.name for m in self.modules if m.name in ("ln_f", "lm_head")]
        return ", ".join(parts) or "nothing"


@dataclass(frozen=True)
class Split:
    cards: tuple[CardLoad, ...]
    offloaded: tuple[Module, ...]  # what fits no card (accelerate would put it on the CPU)

    @property
    def holds_weights(self) -> bool:
        """Every module on a card, and no card's weights beyond its budget (one card
        holds the whole model, whether it fits or not)."""
        return not self.offloaded and all(c.weights_bytes <= c.budget_bytes for c in self.cards)

    @property
    def shares(self) -> tuple[Share, ...]:
        return tuple(card.share for card in self.cards)


def modules(shape: ModelShape) -> list[Module]:
    """The model's modules in accelerate's order, with their bytes summing to the weights.

    wte and lm_head are vocab x hidden and ln_f is hidden, in the model's dtype (GPTQ
    leaves them so too); the decoder blocks share the rest evenly (all the same size), and
    what does not divide evenly -- bytes the blocks do not account for -- goes with wte.
    """
    e = shape.dtype_bytes
    embedding, norm = shape.vocab * shape.hidden * e, shape.hidden * e
    left = shape.weights_bytes
    # a hand-made checkpoint smaller than its embeddings: what there is, in order
    head, left = min(embedding, left), left - min(embedding, left)
    ln_f, left = min(norm, left), left - min(norm, left)
    wte, left = min(embedding, left), left - min(embedding, left)
    block = left // shape.layers
    wte += left - block * shape.layers
    return [
        Module("wte", wte),
        *(Module(f"h.{i}", block, i) for i in range(shape.layers)),
        Module("ln_f", ln_f),
        Module("lm_head", head),
    ]


def usable_bytes(gpu_memory_bytes: int) -> int:
    """What accelerate finds free on a card: its memory less the CUDA context."""
    return max(0, gpu_memory_bytes - CUDA_CONTEXT_BYTES)


# The transformers release from which get_balanced_memory's margin counts the largest leaf.
LEAF_MARGIN_SINCE = (5, 18)


def leaf_margin(transformers_release: Optional[tuple[int, ...]]) -> bool:
    """Whether that transformers release's balanced split counts the largest leaf module in
    its margin; None (no transformers installed) plans for the newest."""
    return transformers_release is None or tuple(transformers_release[:2]) >= LEAF_MARGIN_SINCE


def balanced_budgets(
    parts: Sequence[Module], free: Sequence[int], with_leaf: bool = True
) -> list[int]:
    """transformers' get_balanced_memory for cards with `free` bytes each (more than one);
    `with_leaf`: the margin of 5.18 and later (leaf_margin)."""
    total = sum(m.bytes for m in parts)
    largest_block = max((m.bytes for m in parts if m.layer >= 0), default=0)
    largest_leaf = max((m.bytes for m in parts), default=0) if with_leaf else 0
    per_card = total // len(free) + int(1.25 * max(largest_block, largest_leaf))
    # the last card keeps all it has, in case the margin was not enough
    return [min(per_card, f) for f in free[:-1]] + [free[-1]]


def place(parts: Sequence[Module], budgets: Sequence[int]) -> Split:
    """infer_auto_device_map over modules that are never split, cards in order."""
    held: list[list[Module]] = [[] for _ in budgets]
    used = [0] * len(budgets)
    # the largest module after each one: the first card keeps room for it
    after = [0] * len(parts)
    for i in range(len(parts) - 2, -1, -1):
        after[i] = max(after[i + 1], parts[i + 1].bytes)
    card = 0
    for i, module in enumerate(parts):
        while card < len(budgets):
            reserve = after[i] if card == 0 else 0
            if used[card] + module.bytes <= budgets[card] - reserve:
                held[card].append(module)
                used[card] += module.bytes
                break
            card += 1
        else:
            break
    placed = sum(len(h) for h in held)
    cards = tuple(CardLoad(i, budgets[i], tuple(h)) for i, h in enumerate(held))
    return Split(cards, tuple(parts[placed:]))


@lru_cache(maxsize=64)  # plan's searches ask for the same split many times
def split_model(
    shape: ModelShape, gpu_memory_bytes: int, gpus: int, with_leaf: bool = True
) -> Split:
    """The model over `gpus` cards of `gpu_memory_bytes` each, as device_map="auto" puts it
    (`with_leaf`: as transformers 5.18 and later do, leaf_margin). One card holds it all,
    as `.cuda()` or a one-device map loads it, whether it fits or not (`holds_weights` says
    which)."""
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, not {gpus}")
    free = usable_bytes(gpu_memory_bytes)
    parts = modules(shape)
    if gpus == 1:
        return Split((CardLoad(0, free, tuple(parts)),), ())
    return place(parts, balanced_budgets(parts, [free] * gpus, with_leaf))


def fewest_gpus(
    shape: ModelShape, gpu_memory_bytes: int, limit: int = MAX_GPUS, with_leaf: bool = True
) -> int:
    """The fewest cards of this size whose split holds the weights; 0 when not even
    `limit` do."""
    for gpus in range(1, limit + 1):
        if split_model(shape, gpu_memory_bytes, gpus, with_leaf).holds_weights:
            return gpus
    return 0
