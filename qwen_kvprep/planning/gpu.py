"""The default for `plan --gpu-memory`: the total memory of the GPU torch sees."""

from __future__ import annotations

from qwen_kvprep.errors import UsageError

_NO_GPU_FIX = "pass the card's memory, e.g. --gpu-memory 80GiB (or 24GB, 81920MiB)"


def visible_gpu_memory() -> tuple[int, str]:
    """(total bytes, description) of CUDA device 0; UsageError naming --gpu-memory when
    there is none. torch is imported only here: plan with --gpu-memory never loads it."""
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
            "no GPU is visible to torch, so --gpu-memory has no default", fix=_NO_GPU_FIX
        )
    props = cuda.get_device_properties(0)
    return int(props.total_memory), f"cuda:0 ({props.name})"
