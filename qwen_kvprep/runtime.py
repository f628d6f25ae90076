"""Child-side helpers shared by smoke and profile: where to run, how much memory was used,
which modules are the attention layers, whether they ran the compiled kernel, and what
the returned cache holds.

Imported only inside child processes (torch is imported lazily all the same, so that a
broken torch is reported by the child's error event, not as an import crash).
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import logging
import resource
import sys
import warnings
from collections.abc import Iterator
from typing import Any, Optional

FLAG = "use_cache_quantization"


class _Capture(logging.Handler):
    def __init__(self, sink: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.sink.append(record.getMessage())
        except Exception:  # a bad format string in model code must not kill the child
            self.sink.append(str(record.msg))


@contextlib.contextmanager
def captured_warnings() -> Iterator[list[str]]:
    """Collect the warnings Python and the loggers emit meanwhile (the model's fallback
    warnings among them), one per occurrence; they are echoed to stderr afterwards so the
    child's log keeps them too."""
    messages: list[str] = []
    handler = _Capture(messages)
    # transformers' own loggers do not propagate to the root logger; remote code
    # (transformers_modules.*) does. Listen on both.
    loggers = [logging.getLogger(), logging.getLogger("transformers")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # one warning per layer, not one per site
            yield messages
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
        messages[:0] = [str(w.message) for w in caught]
        for m in messages:
            print(f"warning during load: {m}", file=sys.stderr)


def rss_peak_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes
    return int(peak if sys.platform == "darwin" else peak * 1024)


def resolve_device(requested: str, torch: Any) -> str:
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"--device cuda, but torch {torch.__version__} sees no GPU "
            f"(torch.version.cuda={torch.version.cuda})"
        )
    return requested


def has_accelerate() -> bool:
    return importlib.util.find_spec("accelerate") is not None


def flagged_modules(model: Any) -> list[tuple[str, Any]]:
    return [(n, m) for n, m in model.named_modules() if hasattr(m, FLAG)]


def attention_layers(model: Any) -> list[tuple[str, Any]]:
    """The leaf-most modules carrying the quantization flag: the attention layers (the
    model-level module carries the flag too, to read the cache length)."""
    flagged = flagged_modules(model)
    names = [n for n, _ in flagged]
    return [
        (n, m) for n, m in flagged if not any(o != n and o.startswith(n + ".") for o in names)
    ]


def set_cache_quantization(model: Any, on: bool) -> list[tuple[Any, Any]]:
    """Switch the quantized cache of a loaded model; returns what to restore.

    The layers read their own attribute; the config is switched too in case some code
    path reads it at run time. The kernel stays loaded, so switching back costs nothing.
    """
    targets = [m for _, m in flagged_modules(model)]
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, FLAG):
        targets.append(config)
    saved = [(m, getattr(m, FLAG)) for m in targets]
    for m in targets:
        setattr(m, FLAG, on)
    return saved


def restore(saved: list[tuple[Any, Any]]) -> None:
    for m, value in saved:
        setattr(m, FLAG, value)


def kernel_info(module: Any) -> dict[str, Any]:
    kernels = getattr(module, "cache_kernels", None)
    if kernels is None:
        return {"loaded": False, "module": None, "file": None, "compiled": False}
    path = getattr(kernels, "__file__", None)
    compiled = bool(path) and str(path).endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))
    return {
        "loaded": True,
        "module": getattr(kernels, "__name__", type(kernels).__name__),
        "file": str(path) if path else None,
        "compiled": compiled,
    }


class CountingKernels:
    """Stands in for a layer's `cache_kernels` and counts calls into the extension, so
    "the kernel ran" is observed rather than inferred from the attribute being set."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return attr(*args, **kwargs)

        return counted


def tensors_in(obj: Any) -> list[Any]:
    """Every tensor in a nest of tuples and lists (a cache, quantized or not)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for item in obj for t in tensors_in(item)]
    return []


def legacy_cache(past: Any) -> Any:
    # newer transformers may hand back a Cache object; the remote code itself uses tuples
    to_legacy = getattr(past, "to_legacy_cache", None)
    return to_legacy() if callable(to_legacy) else past


class KernelCounter:
    """Counts, per attention layer, the calls into the compiled extension from now on.

    qwen-kvprep's own model code counts them itself (`kernel_calls`); Qwen's real
    modeling_qwen.py does not, so there the layer's extension module is wrapped in a
    CountingKernels proxy. A layer without a loaded extension counts 0.
    """

    def __init__(self, layers: list[tuple[str, Any]]) -> None:
        self.modules = [m for _, m in layers]
        self.proxies: list[Optional[CountingKernels]] = []
        for mod in self.modules:
            proxy = None
            if hasattr(mod, "kernel_calls"):
                mod.kernel_calls = 0
            elif getattr(mod, "cache_kernels", None) is not None:
                proxy = CountingKernels(mod.cache_kernels)
                mod.cache_kernels = proxy
            self.proxies.append(proxy)

    def calls(self) -> list[int]:
        return [
            p.calls if p is not None else int(getattr(m, "kernel_calls", 0) or 0)
            for m, p in zip(self.modules, self.proxies)
        ]

    def kernel_layers(self) -> int:
        return sum(1 for c in self.calls() if c > 0)


def cache_nbytes(past: Any) -> int:
    """Bytes of every tensor the model returned as its cache (codes, scales and zero
    points for the quantized one). numel * element_size, not storage size: key/value may
    be views of one projection output, but what a cache holds is their logical size."""
    return sum(t.numel() * t.element_size() for t in tensors_in(legacy_cache(past)))


def cache_length(past: Any) -> Optional[int]:
    """Tokens in the cache: ((q, scale, zero), ...) is [b, h, s, d]; (key, value) plain is
    [b, s, h, d] (the layouts of Qwen's remote code)."""
    layers = legacy_cache(past)
    try:
        first = layers[0][0]
        if isinstance(first, (tuple, list)):
            return int(first[0].shape[2])
        return int(first.shape[1])
    except (IndexError, TypeError, AttributeError):
        return None
