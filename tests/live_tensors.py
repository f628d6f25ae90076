"""Peak bytes of live tensor storage during a run on CPU: what the CUDA caching allocator's
max_memory_allocated would count, measured without a GPU.

A TorchDispatchMode sees every op's outputs; their storages are tracked through weak
references, so a storage counts from the op that made it until it is freed. Views share
their base's storage and are counted once. Used to check plan's derivation against the
tiny model's real allocations (tests/test_plan.py).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


class LiveTensors(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.total = 0
        self.peak = 0
        self.paused = False

    def add(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        ref = StorageWeakRef(storage)
        # holding the weak reference keeps the address from being reused by a new storage
        if ref.cdata not in self.live:
            self.live[ref.cdata] = (ref, storage.nbytes())
            self.total += storage.nbytes()

    def _sweep(self) -> None:
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            self.total -= self.live.pop(key)[1]

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Any = (), kwargs: Optional[dict[str, Any]] = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if not self.paused:
            # drop what died since the last op first: the peak is the moment this op's
            # outputs exist beside everything still referenced
            self._sweep()
            # tree_flatten, not tree_leaves: torch 2.1 has only the former
            for leaf in pytree.tree_flatten(out)[0]:
                if isinstance(leaf, torch.Tensor):
                    self.add(leaf)
            self.peak = max(self.peak, self.total)
        return out


class FakeKernels:
    """The two extension calls the model makes, computed with tracking paused: the real
    kernels write into the zeroed output they are given and allocate nothing else."""

    def __init__(self, tracker: LiveTensors) -> None:
        self.tracker = tracker

    def vecquant8matmul_batched_faster_old(
        self, vec: Any, mat: Any, mul: Any, scales: Any, zeros: Any
    ) -> None:
        self.tracker.paused = True
        try:
            key = scales.float() * (mat.float().transpose(-1, -2) - zeros.float())
            mul.copy_(torch.matmul(vec.float(), key.transpose(-1, -2)))
        finally:
            self.tracker.paused = False

    def vecquant8matmul_batched_column_compression_faster_old(
        self, vec: Any, mat: Any, mul: Any, scales: Any, zeros: Any
    ) -> None:
        self.tracker.paused = True
        try:
            mul.copy_(torch.matmul(vec.float(), scales.float() * (mat.float() - zeros.float())))
        finally:
            self.tracker.paused = False


def load(directory: str, int8: bool) -> Any:
    from transformers import AutoModelForCausalLM

    flags = (
        {"use_cache_quantization": True, "use_cache_kernel": True, "use_flash_attn": False}
        if int8
        else {}
    )
    return AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True, **flags).eval()


def measure(
    model: Any, batch: int, prompt: int, new: int, chunk: Optional[int] = None,
    fast_path: bool = False,
) -> int:
    """Peak live bytes (weights included) of the contract's run: the prompt in chunks, then
    `new` greedy steps of one token, each a forward with the cache.

    fast_path: the model's Int8 cache runs through qwen-kvprep's fast path with the real
    extension (its ATen operations pass through the tracker like any other; the kernels
    write into tensors they are given); each run starts without buffers, as in a fresh
    process."""
    tracker = LiveTensors()
    for module in model.modules():
        if fast_path:
            module.__dict__.pop("_qwen_kvprep_buffers", None)
        elif hasattr(module, "cache_kernels") and getattr(module, "use_cache_quantization", 0):
            module.cache_kernels = FakeKernels(tracker)
    with torch.inference_mode():
        for tensor in [*model.parameters(), *model.buffers()]:
            tracker.add(tensor)
        tracker.peak = tracker.total
        ids = torch.full((batch, prompt), 5, dtype=torch.long)
        step = chunk or prompt
        with tracker:
            past = None
            for start in range(0, prompt, step):
                out = model(
                    input_ids=ids[:, start : start + step], past_key_values=past, use_cache=True
                )
                past = out.past_key_values
            token = out.logits[:, -1, :].float().argmax(-1)
            for _ in range(new):
                out = model(input_ids=token[:, None], past_key_values=past, use_cache=True)
                past = out.past_key_values
                token = out.logits[:, -1, :].argmax(-1)
    return tracker.peak
