"""Child side of `qwen-kvprep profile`: `python -m qwen_kvprep.profile.child --fd N --spec JSON`.

One process per measurement, so that one run's memory peak cannot leak into the next
(the CUDA caching allocator and the CPU heap both keep what they once held).

A generation run (the plan contract's procedure, which `plan` predicts):
1. load the model in its dtype on the device: `from_pretrained` as a server would, or,
   with random weights, the architecture built from config.json directly on the device
   (under `with torch.device(...)`, so a 72B model is never materialised in host memory);
   the mode is chosen by from_pretrained keyword arguments: int8 turns on
   use_cache_quantization and use_cache_kernel, unquantized turns both off, and both
   turn use_flash_attn off so that the two modes differ in the cache alone (the remote
   code does not switch flash attention off by itself, and its flash path cannot take a
   quantized cache);
2. B identical rows of P synthetic token ids (seeded; memory and speed do not depend on
   which ids), fed in chunks of C tokens (all P at once without C), each chunk one
   forward with the cache of the previous ones;
3. N greedy decode steps, one token per row and one forward each, with the cache; the
   cache then holds P + N tokens.
The peak is torch.cuda.max_memory_allocated() over the whole run, weights included (never
reset), or the process's peak RSS on a CPU. Only what the model itself keeps is kept
between forwards: the cache and the next tokens (the previous output object, whose
logits are as large as batch x chunk x vocabulary in a prefill, is dropped first).

An out-of-memory error (torch.OutOfMemoryError, "CUDA out of memory", a CPU allocator's
"can't allocate memory", MemoryError) is a result (`oom: true`), not a failure.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Optional, Union

from qwen_kvprep.childproc import Events, child_main, exit_child
from qwen_kvprep.profile.protocol import (
    ENV_SIMULATE_OOM,
    PHASE_DECODE,
    PHASE_LOAD,
    PHASE_PREFILL,
    TASK_PROBE,
    TASK_QUALITY,
    TASK_RUN,
    ChildSpec,
    DeviceInfo,
    Generation,
    Loaded,
    ProbeResult,
    QualityRunResult,
    RunAnswer,
    RunResult,
)
from qwen_kvprep.runtime import (
    FAST_OFF,
    FAST_STEPS,
    KernelCounter,
    attention_layers,
    cache_length,
    cache_nbytes,
    captured_warnings,
    has_accelerate,
    input_device,
    model_from_config,
    moved_to_gpu,
    pretrained_config,
    pretrained_model,
    resolve_device,
    rss_peak_bytes,
)

if TYPE_CHECKING:
    from transformers.modeling_utils import PreTrainedModel

    from qwen_kvprep.jsontypes import JSONObject
    from qwen_kvprep.runtime import ModelOutput

# At most this often a progress event during decoding: enough for a live bar, and a
# negligible cost next to a forward.
_PROGRESS_EVERY_S = 0.25


def mode_flags(mode: str) -> dict[str, bool]:
    quantized = mode == "int8"
    return {
        "use_cache_quantization": quantized,
        "use_cache_kernel": quantized,
        "use_flash_attn": False,
    }


def resolve_dtype(spec: ChildSpec, device: str) -> str:
    """--dtype, else the flag config.json sets, else what Qwen's remote code picks when
    none is set (bf16 where the GPU supports it, else fp16 from compute capability 7,
    else fp32; fp32 on a CPU)."""
    if spec.dtype:
        return spec.dtype
    import json

    import torch

    cfg: JSONObject
    try:
        cfg = json.loads((Path(spec.source) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        cfg = {}
    for name in ("bf16", "fp16", "fp32"):
        if cfg.get(name) is True:
            return name
    if device == "cuda":
        if torch.cuda.is_bf16_supported():
            return "bf16"
        return "fp16" if torch.cuda.get_device_capability(0)[0] >= 7 else "fp32"
    return "fp32"


def plant_kernels(source: Path) -> None:
    """Put the loader and the kernel sources beside the modules-cache copy of the model
    code, where the model looks for them (transformers copies only .py files there)."""
    from qwen_kvprep.common import FAST_FILE, KERNEL_FILES, LOADER_FILE
    from qwen_kvprep.modcache import module_folder

    folder = module_folder(source)
    for name in (LOADER_FILE, *KERNEL_FILES):
        shutil.copyfile(source / name, folder / name)
    if (source / FAST_FILE).is_file():  # the fast path, when the model code imports it
        shutil.copyfile(source / FAST_FILE, folder / FAST_FILE)


def load(spec: ChildSpec, device: str) -> tuple[PreTrainedModel, Loaded]:
    import torch

    source = Path(spec.source)
    if spec.plant_kernels:
        plant_kernels(source)
    dtype = resolve_dtype(spec, device)
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    # All three precision flags explicitly, so the remote code's own resolution agrees.
    flags = dict(mode_flags(spec.mode), bf16=dtype == "bf16", fp16=dtype == "fp16",
                 fp32=dtype == "fp32")
    with captured_warnings() as messages:
        t0 = time.perf_counter()
        if spec.random_weights:
            config = pretrained_config(source, **flags)
            torch.manual_seed(spec.seed)
            with torch.device(device):
                model = model_from_config(config, torch_dtype=torch_dtype)
        else:
            kwargs: dict[str, dict[str, int]] = {}
            if device == "cuda" and has_accelerate():
                # the whole model on the one GPU measured: an offload to the host would
                # hide exactly the memory this command is about
                kwargs["device_map"] = {"": 0}
            model = pretrained_model(source, torch_dtype=torch_dtype, **flags, **kwargs)
            if device == "cuda" and "device_map" not in kwargs:
                model = moved_to_gpu(model)
        model.eval()  # type: ignore[no-untyped-call, unused-ignore]
        _sync(device)
        load_s = time.perf_counter() - t0
    return model, {"dtype": dtype, "load_seconds": load_s, "load_warnings": messages}


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def peak_bytes(device: str) -> int:
    if device == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated())
    return rss_peak_bytes()


def oom_types(torch: ModuleType) -> tuple[type[BaseException], ...]:
    """The out-of-memory exceptions the torch module `torch` defines, and MemoryError."""
    found: list[type[BaseException]] = [MemoryError]
    for owner in (torch, getattr(torch, "cuda", None)):
        cls = getattr(owner, "OutOfMemoryError", None)
        if isinstance(cls, type) and issubclass(cls, BaseException):
            found.append(cls)
    return tuple(found)


def is_oom(exc: BaseException, torch: ModuleType) -> bool:
    """Whether `exc` (or what it was raised from) is an allocator running out of memory."""
    seen: set[int] = set()
    current: Optional[BaseException] = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, oom_types(torch)):
            return True
        text = str(current)
        # CUDA's and HIP's "... out of memory", torch's CPU allocator, and cuBLAS failing
        # to allocate its workspace on a full GPU
        if isinstance(current, RuntimeError) and (
            "out of memory" in text.lower()
            or "can't allocate memory" in text
            or "CUBLAS_STATUS_ALLOC_FAILED" in text
        ):
            return True
        current = current.__cause__ or current.__context__
    return False


def simulate_oom(batch: int, torch: ModuleType) -> None:
    """Test-only (ENV_SIMULATE_OOM): fail the batch's allocation like a full device."""
    limit = os.environ.get(ENV_SIMULATE_OOM)
    if limit and batch > int(limit):
        cls = oom_types(torch)[-1]
        raise cls(
            f"simulated out of memory ({ENV_SIMULATE_OOM}={limit}): "
            f"tried to allocate a batch of {batch}"
        )


def generate(model: PreTrainedModel, spec: ChildSpec, device: str, ev: Events) -> Generation:
    import torch

    batch, prompt, new = spec.batch, spec.prompt_tokens, spec.new_tokens
    chunk = spec.prefill_chunk or prompt
    gen = torch.Generator().manual_seed(spec.seed)
    row = torch.randint(0, int(model.config.vocab_size), (1, prompt), generator=gen)
    simulate_oom(batch, torch)
    ids = row.repeat(batch, 1).to(input_device(model))
    with torch.inference_mode():
        ev.start(PHASE_PREFILL)
        _sync(device)
        t0 = time.perf_counter()
        past: object = None
        for start in range(0, prompt, chunk):
            out: ModelOutput = model(input_ids=ids[:, start : start + chunk],
                                     past_key_values=past, use_cache=True)
            past = out.past_key_values
            last = out.logits[:, -1, :]
            del out
        token = last.argmax(dim=-1)
        del last
        _sync(device)
        t1 = time.perf_counter()
        ev.start(PHASE_DECODE)
        shown = time.monotonic()
        for step in range(new):
            out = model(input_ids=token[:, None], past_key_values=past, use_cache=True)
            past = out.past_key_values
            token = out.logits[:, -1, :].argmax(dim=-1)
            del out
            if time.monotonic() - shown >= _PROGRESS_EVERY_S:
                shown = time.monotonic()
                ev.send({"event": "progress", "phase": PHASE_DECODE, "done": step + 1,
                         "total": new})
        _sync(device)
        t2 = time.perf_counter()
    return {
        "cached_tokens": cache_length(past),
        "kv_bytes": cache_nbytes(past),
        "prefill_seconds": t1 - t0,
        "decode_seconds": t2 - t1,
        "prefill_tokens_per_s": batch * prompt / (t1 - t0) if t1 > t0 else None,
        "decode_tokens_per_s": batch * new / (t2 - t1) if t2 > t1 else None,
    }


def run_generation(spec: ChildSpec, device: str, ev: Events) -> RunAnswer:
    import torch

    result: RunAnswer = {"oom": False, "error": None}
    counter: Optional[KernelCounter] = None
    layers: list[tuple[str, torch.nn.Module]] = []
    try:
        ev.start(PHASE_LOAD)
        model, loaded = load(spec, device)
        result = {**result, **loaded}
        layers = attention_layers(model)
        result["layers"] = len(layers)
        for _, mod in layers:
            setattr(mod, FAST_STEPS, 0)
            if not spec.fast_path:
                setattr(mod, FAST_OFF, True)
        counter = KernelCounter(layers)
        result = {**result, **generate(model, spec, device, ev)}
    except BaseException as exc:
        if not is_oom(exc, torch):
            raise
        result["oom"] = True
        result["oom_phase"] = ev.phase
        result["error"] = f"{type(exc).__name__}: {_first_line(exc)}"
    result["kernel_layers"] = counter.kernel_layers() if counter is not None else 0
    result["kernel_calls"] = counter.calls() if counter is not None else []
    result["fast_layers"] = sum(1 for _, m in layers if getattr(m, FAST_STEPS, 0)) if layers else 0
    result["peak_bytes"] = peak_bytes(device)
    return result


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def device_info(device: str) -> ProbeResult:
    import platform

    import torch
    import transformers

    from qwen_kvprep import __version__

    info: DeviceInfo
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        enabled = getattr(torch.backends.cuda, "cudnn_sdp_enabled", None)
        info = {
            "kind": device,
            "name": props.name,
            "total_bytes": int(props.total_memory),
            "capability": f"{props.major}.{props.minor}",
            "count": torch.cuda.device_count(),
            # None: a torch without a cuDNN attention backend
            "cudnn_attention": bool(enabled()) if enabled is not None else None,
        }
    else:
        total: Optional[int]
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            total = None
        info = {"kind": device, "name": platform.processor() or platform.machine(),
                "total_bytes": total, "threads": torch.get_num_threads()}
    return {
        "device": info,
        "versions": {
            "qwen_kvprep": __version__,
            "torch": torch.__version__,
            "torch_cuda": torch.version.cuda,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
    }


def work(spec: ChildSpec, ev: Events) -> Union[ProbeResult, RunResult, QualityRunResult]:
    import torch

    device = resolve_device(spec.device)
    if not spec.cudnn_attention:
        switch = getattr(torch.backends.cuda, "enable_cudnn_sdp", None)
        if switch is not None:
            switch(False)
    result = device_info(device)
    if spec.task == TASK_PROBE:
        return result
    if spec.task == TASK_RUN:
        run: RunResult = {**result, **run_generation(spec, device, ev)}
        return run
    if spec.task == TASK_QUALITY:
        from qwen_kvprep.profile.quality import run_quality

        ev.start(PHASE_LOAD)
        model, loaded = load(spec, device)
        quality: QualityRunResult = {
            **result, **loaded, "quality": run_quality(model, spec, device, ev)
        }
        return quality
    raise ValueError(f"unknown task {spec.task!r}")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qwen_kvprep.profile.child")
    parser.add_argument("--fd", type=int, default=None, help="descriptor for the events")
    parser.add_argument("--spec", required=True, help="the task, as ChildSpec JSON")
    args = parser.parse_args(argv)
    spec = ChildSpec.from_json(args.spec)
    return child_main(args.fd, lambda ev: work(spec, ev))


if __name__ == "__main__":
    exit_child(main())
