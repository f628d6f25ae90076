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
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Protocol, TypedDict, Union, cast

if TYPE_CHECKING:
    import torch
    from transformers.configuration_utils import PretrainedConfig
    from transformers.modeling_utils import PreTrainedModel
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    # What Qwen's remote code caches per layer: (key, value), each a tensor, or with the
    # Int8 cache a (codes, scale, zero) triple.
    CachedKV = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    LayerCache = tuple[CachedKV, CachedKV]
    LegacyCache = Sequence[LayerCache]

# The attributes of Qwen's attention layers read and switched here. Named once: nn.Module's
# __setattr__ is typed for tensors and modules, so they are set with setattr.
FLAG = "use_cache_quantization"
KERNELS = "cache_kernels"  # the loaded extension module, or None on the fallback path
CALLS = "kernel_calls"  # qwen-kvprep's own model code counts its kernel calls
# qwen-kvprep's fast path (templates/qwen_kvprep_kv.py): set on the classes it patched, and
# counted per attention layer; a layer with FAST_OFF set runs the model's own code
FAST_MARK = "_qwen_kvprep_fast"
# qwen-kvprep's compatibility module (templates/qwen_kvprep_compat.py): set on the model's
# base class, the changes it made for the running transformers
COMPAT_MARK = "_qwen_kvprep_compat"
FAST_STEPS = "qwen_kvprep_fast_steps"
FAST_OFF = "qwen_kvprep_fast_off"


class KernelInfo(TypedDict):
    """What a layer's `cache_kernels` is."""

    loaded: bool
    module: Optional[str]
    file: Optional[str]
    compiled: bool  # a compiled extension, not a Python stand-in


class ModelOutput(Protocol):
    """What the forward of a causal LM returns (transformers' CausalLMOutputWithPast)."""

    @property
    def logits(self) -> torch.Tensor: ...

    @property
    def past_key_values(self) -> object: ...  # passed back in; read with legacy_cache


# One typed entry point for each transformers loader: theirs return Any or are unannotated.


def pretrained_tokenizer(source: Union[str, Path]) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    # untyped in transformers: AutoTokenizer.from_pretrained(path, *inputs, **kwargs)
    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(  # type: ignore[no-untyped-call, unused-ignore]
        source, trust_remote_code=True
    )
    return tokenizer


def pretrained_config(source: Union[str, Path], **flags: object) -> PretrainedConfig:
    from transformers import AutoConfig

    config: PretrainedConfig = AutoConfig.from_pretrained(source, trust_remote_code=True, **flags)
    return config


def pretrained_model(source: Union[str, Path], **kwargs: object) -> PreTrainedModel:
    from transformers import AutoModelForCausalLM

    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
        source, trust_remote_code=True, **kwargs
    )
    return model


def model_from_config(config: PretrainedConfig, **kwargs: object) -> PreTrainedModel:
    from transformers import AutoModelForCausalLM

    # untyped in transformers: _BaseAutoModelClass.from_config(config, **kwargs)
    model: PreTrainedModel = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
        config, trust_remote_code=True, **kwargs
    )
    return model


def moved_to_gpu(model: PreTrainedModel) -> PreTrainedModel:
    """`model.to("cuda")`: PreTrainedModel.to is wrapped in functools.wraps, which hides
    it from type checkers as a method; nn.Module.to returns the module itself."""
    module: torch.nn.Module = model
    return cast("PreTrainedModel", module.to("cuda"))


def input_device(model: PreTrainedModel) -> torch.device:
    """Where the model takes its input ids: the device of its input embeddings."""
    import torch

    try:
        weight = model.get_input_embeddings().weight
    except (AttributeError, NotImplementedError):  # remote code without the accessor
        weight = None
    if isinstance(weight, torch.Tensor):
        return weight.device
    return next(model.parameters()).device


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


def resolve_device(requested: str) -> str:
    import torch

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


def flagged_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if hasattr(m, FLAG)]


def attention_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The leaf-most modules carrying the quantization flag: the attention layers (the
    model-level module carries the flag too, to read the cache length)."""
    flagged = flagged_modules(model)
    names = [n for n, _ in flagged]
    return [
        (n, m) for n, m in flagged if not any(o != n and o.startswith(n + ".") for o in names)
    ]


# (module or config, the value its flag had)
SavedFlags = list[tuple[object, object]]


def set_cache_quantization(model: torch.nn.Module, on: bool) -> SavedFlags:
    """Switch the quantized cache of a loaded model; returns what to restore.

    The layers read their own attribute; the config is switched too in case some code
    path reads it at run time. The kernel stays loaded, so switching back costs nothing.
    """
    targets: list[object] = [m for _, m in flagged_modules(model)]
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, FLAG):
        targets.append(config)
    saved = [(m, getattr(m, FLAG)) for m in targets]
    for m in targets:
        setattr(m, FLAG, on)
    return saved


def restore(saved: SavedFlags) -> None:
    for m, value in saved:
        setattr(m, FLAG, value)


def kernel_info(module: torch.nn.Module) -> KernelInfo:
    kernels: object = getattr(module, KERNELS, None)
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

    def __init__(self, inner: object) -> None:
        self._inner = inner
        self.calls = 0

    def __getattr__(self, name: str) -> object:
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def counted(*args: object, **kwargs: object) -> object:
            self.calls += 1
            return attr(*args, **kwargs)

        # Kept, so that later lookups find it without coming here: the fast path looks its
        # function up at every step, and a new closure each time would be measured as part
        # of the Int8 runs' speed (the extension's functions do not change).
        self.__dict__[name] = counted
        return counted


def tensors_in(obj: object) -> list[torch.Tensor]:
    """Every tensor in a nest of tuples and lists (a cache, quantized or not)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for item in obj for t in tensors_in(item)]
    return []


def legacy_cache(past: object) -> LegacyCache:
    # newer transformers may hand back a Cache object; the remote code itself uses tuples
    to_legacy = getattr(past, "to_legacy_cache", None)
    # in the layout of Qwen's remote code (see LegacyCache); readers of it stay defensive
    return cast("LegacyCache", to_legacy() if callable(to_legacy) else past)


class KernelCounter:
    """Counts, per attention layer, the calls into the compiled extension from now on.

    qwen-kvprep's own model code counts them itself (`kernel_calls`); Qwen's real
    modeling_qwen.py does not, so there the layer's extension module is wrapped in a
    CountingKernels proxy. A layer without a loaded extension counts 0.
    """

    def __init__(self, layers: list[tuple[str, torch.nn.Module]]) -> None:
        self.modules = [m for _, m in layers]
        self.proxies: list[Optional[CountingKernels]] = []
        for mod in self.modules:
            proxy = None
            if hasattr(mod, CALLS):
                setattr(mod, CALLS, 0)
            elif getattr(mod, KERNELS, None) is not None:
                proxy = CountingKernels(getattr(mod, KERNELS))
                setattr(mod, KERNELS, proxy)
            self.proxies.append(proxy)

    def calls(self) -> list[int]:
        return [
            p.calls if p is not None else int(getattr(m, CALLS, 0) or 0)
            for m, p in zip(self.modules, self.proxies)
        ]

    def kernel_layers(self) -> int:
        return sum(1 for c in self.calls() if c > 0)


def cache_nbytes(past: object) -> int:
    """Bytes of every tensor the model returned as its cache (codes, scales and zero
    points for the quantized one). numel * element_size, not storage size: key/value may
    be views of one projection output, but what a cache holds is their logical size."""
    return sum(t.numel() * t.element_size() for t in tensors_in(legacy_cache(past)))


def cache_length(past: object) -> Optional[int]:
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


# -- GPTQ ---------------------------------------------------------------------------------
# The packed tensors every GPTQ linear module holds, whichever backend made it (gptqmodel's
# TorchQuantLinear, TritonV2QuantLinear, ...; auto-gptq's QuantLinear classes).
GPTQ_TENSORS = ("qweight", "qzeros", "scales")


def is_gptq_model(model: torch.nn.Module) -> bool:
    """True when the loaded model's config says GPTQ (`quantization_config.quant_method`)."""
    config = getattr(model, "config", None)
    qc: object = getattr(config, "quantization_config", None)
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    return str(getattr(method, "value", method) or "").lower() == "gptq"


def gptq_linears(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The modules that compute a linear layer from GPTQ-packed weights."""
    import torch

    return [
        (name, mod)
        for name, mod in model.named_modules()
        if all(isinstance(getattr(mod, t, None), torch.Tensor) for t in GPTQ_TENSORS)
    ]


def plain_block_linears(model: torch.nn.Module) -> list[str]:
    """`nn.Linear` modules inside the transformer blocks (`...h.N....`): none in a GPTQ model."""
    import torch

    return [
        name
        for name, mod in model.named_modules()
        if isinstance(mod, torch.nn.Linear) and ".h." in f".{name}"
    ]


class CallCounter:
    """Counts forward calls of some modules through forward hooks, until `remove()`."""

    def __init__(self, modules: list[tuple[str, torch.nn.Module]]) -> None:
        self.counts = dict.fromkeys((n for n, _ in modules), 0)
        self._handles = [
            mod.register_forward_hook(self._hook(name)) for name, mod in modules
        ]

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(*_: object) -> None:
            self.counts[name] += 1

        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
