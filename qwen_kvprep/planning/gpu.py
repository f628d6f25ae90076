"""The GPU `plan` plans for: the one torch sees, a card named with `--gpu`, or a size.

The capacities below are what torch reports as `torch.cuda.get_device_properties(i)
.total_memory` on each card (CUDA's `totalGlobalMem`, the figure deviceQuery prints as
"Total amount of global memory" and torch's out-of-memory messages as "total capacity").
It is less than the card's label and less than nvidia-smi's total, and it moves by a few
tens of MiB with the driver: where several were seen, the smallest is listed, so a plan
that fits the named card fits it under any of them. Plan on the card itself (no --gpu) to
use the exact figure of that machine.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from qwen_kvprep.errors import UsageError

_MIB = 2**20
_NO_GPU_FIX = (
    "name the card, e.g. --gpu a100-80g (`--gpu list` shows the names), or give its "
    "memory, e.g. --gpu-memory 80Gi"
)


@dataclass(frozen=True)
class Card:
    name: str  # what --gpu takes
    product: str  # the device name torch reports
    total_bytes: int  # torch's total_memory on it
    aliases: tuple[str, ...] = ()


# Sources: deviceQuery logs in public repositories and issue threads (driver/runtime
# version given), and, where no such log was found, PyTorch's out-of-memory messages,
# which print the same total rounded to 0.01 GiB.
CARDS: tuple[Card, ...] = (
    # deviceQuery, driver 13.0 / runtime 12.5: 81079 MiB (85017755648 bytes). Other drivers
    # report 81090 and 81106 MiB; nvidia-smi's total is 81559 MiB.
    Card("h100", "NVIDIA H100 80GB HBM3", 85017755648, ("h100-80g", "h100-sxm")),
    # PyTorch out-of-memory messages on H200 (141 GB HBM3e): "total capacity of 139.80 GiB".
    Card("h200", "NVIDIA H200", 143155 * _MIB, ("h200-141g",)),
    # deviceQuery, driver 12.2: 81051 MiB (84987740160 bytes); the PCIe card reports
    # 81049 MiB (mixbench), driver 12.5 81158 MiB; nvidia-smi says 81920 MiB.
    Card("a100-80g", "NVIDIA A100-SXM4-80GB", 84987740160, ("a100-sxm4-80g", "a800-80g")),
    # deviceQuery, driver 12.2 / runtime 11.4: 40339 MiB (42298834944 bytes).
    Card("a100-40g", "NVIDIA A100-SXM4-40GB", 42298834944, ("a100-sxm4-40g",)),
    # cuda-device-query, driver 12.4: 45373 MiB (47576711168 bytes); nvidia-smi 46068 MiB.
    Card("l40s", "NVIDIA L40S", 47576711168),
    # deviceQuery, driver 12.0 / runtime 11.8: 22518 MiB (23612293120 bytes).
    Card("l4", "NVIDIA L4", 23612293120),
    # PyTorch out-of-memory messages on A10G (AWS g5): "total capacity of 21.99 GiB".
    Card("a10g", "NVIDIA A10G", 22517 * _MIB),
    # deviceQuery, driver 12.9: 32494 MiB (34072559616 bytes); drivers 11.4 and 11.6 report
    # 32510 and 32511 MiB.
    Card("v100-32g", "Tesla V100-SXM2-32GB", 34072559616, ("v100-sxm2-32g",)),
    # deviceQuery on Linux, driver 13.0: 24081 MiB (25250627584 bytes); driver 12.4 reports
    # 24210 MiB. (Windows reserves more: 23028 MiB under WDDM.)
    Card("4090", "NVIDIA GeForce RTX 4090", 25250627584, ("rtx4090", "rtx-4090")),
    # deviceQuery, driver 12.4: 24039 MiB (25206325248 bytes); drivers 11.4 and 11.8 report
    # 24235 and 24268 MiB.
    Card("3090", "NVIDIA GeForce RTX 3090", 25206325248, ("rtx3090", "rtx-3090")),
    # deviceQuery, driver 12.8: 32117 MiB (33677180928 bytes).
    Card("5090", "NVIDIA GeForce RTX 5090", 33677180928, ("rtx5090", "rtx-5090")),
)

# Names that stand for more than one card: say which to pick instead of guessing.
_AMBIGUOUS = {"a100": ("a100-40g", "a100-80g"), "v100": ("v100-32g",)}


def _key(name: str) -> str:
    """Spellings people use for one card fold to one key: "RTX 4090", "rtx-4090" and
    "4090"; "A100-80GB", "a100_80g" and "a100 80g"."""
    key = name.strip().lower()
    key = re.sub(r"\b(nvidia|geforce|tesla)\b", "", key)
    key = re.sub(r"[\s_-]+", "", key)
    key = re.sub(r"(\d)gb$", r"\1g", key)
    return key.removeprefix("rtx") if key.startswith("rtx") and key[3:].isdigit() else key


# the device name too, as torch and nvidia-smi print it ("NVIDIA H100 80GB HBM3")
_BY_KEY = {
    _key(alias): card for card in CARDS for alias in (card.name, card.product, *card.aliases)
}


def find_card(name: str) -> Card:
    """The card `--gpu NAME` names; UsageError listing the names otherwise."""
    key = _key(name)
    card = _BY_KEY.get(key)
    if card is not None:
        return card
    if key in _AMBIGUOUS:
        choices = ", ".join(_AMBIGUOUS[key])
        raise UsageError(
            f"--gpu {name}: which one? {choices}" + (
                " (or give another size with --gpu-memory)" if len(_AMBIGUOUS[key]) == 1
                else ""),
            fix=f"--gpu {_AMBIGUOUS[key][-1]}",
        )
    raise UsageError(
        f"--gpu {name}: not a card qwen-kvprep knows",
        fix=f"one of {', '.join(c.name for c in CARDS)} (`--gpu list` shows their "
        "memory), or give the memory torch reports on it: --gpu-memory 81079Mi",
    )


def card_memory(card: Card) -> tuple[int, str]:
    """(bytes, description) for plan, as visible_gpu_memory gives them."""
    return card.total_bytes, f"--gpu {card.name}: {card.product}, as torch reports it"


def render_cards() -> str:
    """`plan --gpu list`: each name with the memory plan takes for it."""
    lines = [f"{'--gpu':<10} {'device (as torch names it)':<26} {'total_memory':>14}"]
    for card in CARDS:
        mib = card.total_bytes / _MIB
        also = f"  (also {', '.join(card.aliases)})" if card.aliases else ""
        lines.append(
            f"{card.name:<10} {card.product:<26} {mib:>10,.0f} MiB  "
            f"{card.total_bytes / 2**30:6.2f} GiB{also}"
        )
    lines.append("")
    lines.append("total_memory is torch's figure (torch.cuda.get_device_properties), a little "
                 "below the label and nvidia-smi's total; it varies by driver. On the machine "
                 "itself, leave --gpu out: plan reads it.")
    return "\n".join(lines)


def cards_json() -> list[dict[str, object]]:
    return [
        {"name": c.name, "device": c.product, "total_bytes": c.total_bytes,
         "aliases": list(c.aliases)}
        for c in CARDS
    ]


def visible_gpu_memory() -> tuple[int, str]:
    """(total bytes, description) of CUDA device 0; UsageError naming --gpu and
    --gpu-memory when there is none. torch is imported only here: plan with --gpu or
    --gpu-memory never loads it."""
    try:
        import torch
    except ImportError as exc:  # plan itself needs no torch: say what to do instead
        raise UsageError(
            f"torch cannot be imported ({exc}), so the GPU's memory is unknown",
            fix=_NO_GPU_FIX,
        ) from exc
    cuda = torch.cuda
    if not cuda.is_available() or cuda.device_count() == 0:
        raise UsageError(
            "no GPU is visible to torch, so plan needs to be told which one to plan for",
            fix=_NO_GPU_FIX,
        )
    props = cuda.get_device_properties(0)
    return int(props.total_memory), f"cuda:0 ({props.name})"
