# qwen-kvprep compatibility: Qwen (v1)'s remote code on the running transformers.
# Written by `qwen-kvprep fix` beside modeling_qwen.py, which imports it; transformers
# copies it into its modules cache. `qwen-kvprep revert DIR` removes it and those lines.
"""What Qwen (v1)'s modeling_qwen.py needs from a transformers newer than the one it was
written for (4.32), decided when the model's code is imported.

modeling_qwen.py, once patched by `qwen-kvprep fix`, ends with a few lines that call
`install(globals())`. `install` looks at the transformers running now and changes only the
model's own classes (never transformers' classes, so other models in the same process are
untouched), and only where this release needs it:

- `generation-mixin` (transformers >= 4.50, whose PreTrainedModel no longer has
  generate): QWenLMHeadModel gets GenerationMixin among its bases, as transformers' Auto
  classes give it to remote code at each load; from the second load in one process on,
  transformers 5 takes the class it registered at the first, without it.
- `tuple-cache` (transformers >= 4.54): generate hands every model an empty `DynamicCache`
  unless the class says it cannot take one; Qwen's code keeps its cache as tuples (and the
  Int8 cache as `(codes, scale, zero)` triples), so the classes say so.
- `head-mask` (transformers 5): `PreTrainedModel.get_head_mask` is gone; Qwen's forward
  calls it, so the model's base class gets the 4.x behaviour back.
- `loaded-numbers` (transformers 5): models are built on the meta device, the checkpoint's
  tensors loaded, then every module not marked as loaded goes through the model's
  `_init_weights`. Qwen's `_init_weights` re-initializes `c_proj.weight` of any module
  that holds one (the attention and the MLP, whose weights were loaded), and nothing
  computes the non-persistent buffers (`inv_freq`, `logn_tensor`, `masked_bias`), which
  are left as uninitialized memory. `_init_weights` then runs the model's own init only
  for modules whose own parameters were all missing from the checkpoint, and computes
  the buffers as the model's `__init__` does.
- `stream` (wherever `transformers_stream_generator` cannot be imported: not installed,
  or transformers >= 4.57, which it no longer imports on): `chat_stream` streams through
  transformers' own streamer interface instead.
- `quiet-deprecations` (transformers 5): three deprecation warnings that Qwen's own code
  sets off in every server's log (`use_return_dict`, `past_key_values`, and `chat`'s
  `generation_config` passed with `return_dict_in_generate`) are dropped when, and only
  when, a frame of this model's code is among their callers: the user cannot act on them
  (the code is Qwen's, no longer maintained) and what it does still works; the same
  warnings set off by the user's own code are logged as before.

`needs()` says which of these apply; `ACTIVE`, after `install`, which were installed.

Whatever the release, `install` also lets the folder serve from a modules cache that fix
never prepared (`_supply`, at the end of this file).
"""

import copy
import logging
import queue
import sys
import threading

import torch
import transformers

MARK = "_qwen_kvprep_compat"  # set on the classes install() changed
ACTIVE = ()  # the needs install() met, for smoke and doctor


def _release():
    parts = []
    for piece in transformers.__version__.split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts + [0] * (2 - len(parts)))


def _stream_generator_imports():
    try:
        import transformers_stream_generator  # noqa: F401
    except Exception:  # it fails with ImportError, AttributeError... on newer transformers
        return False
    return True


def _model_can_generate():
    from transformers import GenerationMixin, PreTrainedModel

    return issubclass(PreTrainedModel, GenerationMixin)


def needs(release=None, stream_ok=None, model_can_generate=None):
    """The changes this transformers needs, in the order install() makes them."""
    release = _release() if release is None else release
    out = []
    if model_can_generate is None:
        model_can_generate = _model_can_generate()
    if not model_can_generate:
        out.append("generation-mixin")
    if release >= (4, 54):
        out.append("tuple-cache")
    if release >= (5, 0):
        out.append("head-mask")
        out.append("loaded-numbers")
    if stream_ok is None:
        stream_ok = _stream_generator_imports()
    if not stream_ok:
        out.append("stream")
    if release >= (5, 0):
        out.append("quiet-deprecations")
    return tuple(out)


def install(namespace):
    """Make the changes `needs()` names on the classes of modeling_qwen.py's namespace."""
    global ACTIVE
    base = namespace.get("QWenPreTrainedModel")
    lm_head = namespace.get("QWenLMHeadModel")
    if base is None or lm_head is None or getattr(base, MARK, None) is not None:
        ACTIVE = tuple(getattr(base, MARK, ()) or ())
        return
    _supply(namespace)
    done = []
    for need in needs():
        if _INSTALLERS[need](namespace):
            done.append(need)
    setattr(base, MARK, tuple(done))
    ACTIVE = tuple(done)


def _generation_mixin(namespace):
    lm_head = namespace["QWenLMHeadModel"]
    from transformers import GenerationMixin

    if issubclass(lm_head, GenerationMixin):
        return False
    # What transformers' Auto classes do for remote code on each load, done once on the
    # class itself: from the second load in a process on, transformers 5 takes the class
    # it registered at the first, without the mixin, and generate() fails
    # ('QWenLMHeadModel' object has no attribute 'generation_config').
    lm_head.__bases__ = (*lm_head.__bases__, GenerationMixin)
    return True


def _tuple_cache(namespace):
    def _supports_default_dynamic_cache(cls):
        return False

    namespace["QWenPreTrainedModel"]._supports_default_dynamic_cache = classmethod(
        _supports_default_dynamic_cache
    )
    return True


def _head_mask(namespace):
    base = namespace["QWenPreTrainedModel"]
    if hasattr(base, "get_head_mask"):
        return False

    def get_head_mask(self, head_mask, num_hidden_layers, is_attention_chunked=False):
        """transformers 4.x's PreTrainedModel.get_head_mask."""
        if head_mask is None:
            return [None] * num_hidden_layers
        if head_mask.dim() == 1:
            head_mask = head_mask[None, None, :, None, None].expand(num_hidden_layers, -1, -1, -1, -1)
        elif head_mask.dim() == 2:
            head_mask = head_mask[:, None, :, None, None]
        head_mask = head_mask.to(dtype=self.dtype)
        if is_attention_chunked:
            head_mask = head_mask.unsqueeze(-1)
        return head_mask

    base.get_head_mask = get_head_mask
    return True


def _loaded(tensor):
    return bool(getattr(tensor, "_is_hf_initialized", False))


def _one_head(config):
    """A copy of the config for the smallest attention layer the model's code builds:
    its buffers depend on the sequence length and head size alone."""
    small = copy.deepcopy(config)
    small.num_attention_heads = 1
    small.hidden_size = getattr(config, "kv_channels", 128)
    small.use_cache_kernel = False  # no extension load for a throw-away layer
    return small


def _fresh(module, config, made):
    """A new instance of the module's class, built by the model's own __init__ on the CPU
    (so its buffers are what the model computes); one per class and arguments."""
    cls = type(module)
    if hasattr(module, "inv_freq") and hasattr(module, "dim") and hasattr(module, "base"):
        key, build = (cls, module.dim, module.base), lambda: cls(module.dim, base=module.base)
    elif hasattr(module, "c_attn"):
        # another model of the same code in this process may have another sequence length
        key, build = (cls, config.to_json_string()), lambda: cls(_one_head(config))
    else:
        return None
    if key not in made:
        with torch.device("cpu"):
            made[key] = build()
    return made[key]


def _refill(module, fresh):
    """Copy what the model's __init__ computed into what a meta-device load left empty."""
    with torch.no_grad():
        for name, value in fresh.named_buffers(recurse=False):
            buffer = getattr(module, name, None)
            if isinstance(buffer, torch.Tensor) and buffer.shape == value.shape:
                buffer.copy_(value.to(device=buffer.device, dtype=buffer.dtype))
    for name in ("cache_qmax", "cache_qmin"):  # plain tensors, never moved off the meta device
        value = getattr(fresh, name, None)
        if isinstance(getattr(module, name, None), torch.Tensor) and isinstance(value, torch.Tensor):
            setattr(module, name, value.clone())
    if hasattr(module, "_rotary_pos_emb_cache"):  # tables made from the empty inv_freq
        module._rotary_pos_emb_cache = None
        module._seq_len_cached = 0
        module._ntk_alpha_cached = 1.0


def _loaded_numbers(namespace):
    base = namespace["QWenPreTrainedModel"]
    own_init = base._init_weights
    made = {}

    def _init_weights(self, module):
        fresh = _fresh(module, self.config, made)
        if fresh is not None:
            _refill(module, fresh)
        params = list(module.parameters(recurse=False))
        if params and not any(_loaded(p) for p in params):
            own_init(self, module)

    base._init_weights = _init_weights
    return True


class _TextQueue:
    """A transformers streamer (put/end) that hands each new token to a queue."""

    def __init__(self):
        self.tokens = queue.Queue()
        self._prompt = True

    def put(self, value):
        if self._prompt:  # generate hands the prompt first
            self._prompt = False
            return
        for token in value.reshape(-1).tolist():
            self.tokens.put(token)

    def end(self):
        self.tokens.put(None)


def _stream(namespace):
    names = ("make_context", "get_stop_words_ids", "StopWordsLogitsProcessor", "LogitsProcessorList")
    if any(name not in namespace for name in names):
        return False  # a revision without Qwen's chat helpers: its chat_stream stays
    lm_head = namespace["QWenLMHeadModel"]
    make_context = namespace["make_context"]
    get_stop_words_ids = namespace["get_stop_words_ids"]
    stop_words_processor = namespace["StopWordsLogitsProcessor"]
    logits_processor_list = namespace["LogitsProcessorList"]

    def chat_stream(
        self,
        tokenizer,
        query,
        history=None,
        system="You are a helpful assistant.",
        stop_words_ids=None,
        logits_processor=None,
        generation_config=None,
        **kwargs,
    ):
        """Qwen's chat_stream, streamed through generate's streamer: yields the response
        decoded so far after each new token."""
        generation_config = generation_config if generation_config is not None else self.generation_config
        if generation_config.chat_format != "chatml":
            raise ValueError("chat_stream supports only the chatml format")
        history = [] if history is None else history
        stop_words_ids = [] if stop_words_ids is None else stop_words_ids
        max_window_size = kwargs.pop("max_window_size", None)
        if max_window_size is None:
            max_window_size = generation_config.max_window_size
        _, context_tokens = make_context(
            tokenizer,
            query,
            history=history,
            system=system,
            max_window_size=max_window_size,
            chat_format=generation_config.chat_format,
        )
        stop_words_ids.extend(get_stop_words_ids(generation_config.chat_format, tokenizer))
        processor = stop_words_processor(
            stop_words_ids=stop_words_ids, eos_token_id=generation_config.eos_token_id
        )
        if logits_processor is None:
            logits_processor = logits_processor_list([processor])
        else:
            logits_processor.append(processor)
        input_ids = torch.tensor([context_tokens]).to(self.device)
        streamer = _TextQueue()
        failure = []

        # the copy says what Qwen's call said as an argument: transformers 5 deprecates a
        # generation_config passed together with generation arguments
        config = copy.deepcopy(generation_config)
        config.return_dict_in_generate = False

        def run():
            try:
                self.generate(
                    input_ids,
                    generation_config=config,
                    logits_processor=logits_processor,
                    streamer=streamer,
                    **kwargs,
                )
            except BaseException as exc:  # handed to the reader below
                failure.append(exc)
                streamer.tokens.put(None)

        def stream_generator():
            worker = threading.Thread(target=run, name="qwen-kvprep-chat-stream", daemon=True)
            worker.start()
            outputs = []
            while True:
                token = streamer.tokens.get()
                if token is None:
                    break
                if token in (generation_config.eos_token_id,):
                    continue
                outputs.append(token)
                yield tokenizer.decode(outputs, skip_special_tokens=True, errors="ignore")
            worker.join()
            if failure:
                raise failure[0]

        return stream_generator()

    lm_head.chat_stream = chat_stream
    return True


# What transformers 5 logs, deprecated, each time Qwen's code runs (the start of each
# message), and the loggers that log them (the modules' own names).
QWEN_DEPRECATIONS = (
    "Passing `generation_config` together with generation-related arguments",
    "`past_key_values`/`cache_params` are deprecated",
    "`use_return_dict` is deprecated",
)
_DEPRECATION_LOGGERS = (
    "transformers.generation.utils",
    "transformers.utils.generic",
    "transformers.configuration_utils",
)
_CALLERS_SEEN = 64  # frames walked up from the log call: generate's, then the caller's


class _FromQwenCode(logging.Filter):
    """Drops QWEN_DEPRECATIONS when a frame of a Qwen model's code called what logs
    them; everything else passes."""

    def __init__(self):
        super().__init__()
        self.namespaces = []  # modeling_qwen.py's globals, one per folder loaded

    def filter(self, record):
        if not isinstance(record.msg, str) or not record.msg.startswith(QWEN_DEPRECATIONS):
            return True
        frame = sys._getframe(1)
        for _ in range(_CALLERS_SEEN):
            if frame is None:
                break
            if any(frame.f_globals is ns for ns in self.namespaces):
                return False
            frame = frame.f_back
        return True


_FILTER = _FromQwenCode()


def _quiet_deprecations(namespace):
    _FILTER.namespaces.append(namespace)
    for name in _DEPRECATION_LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
    return True


_INSTALLERS = {
    "generation-mixin": _generation_mixin,
    "tuple-cache": _tuple_cache,
    "head-mask": _head_mask,
    "loaded-numbers": _loaded_numbers,
    "stream": _stream,
    "quiet-deprecations": _quiet_deprecations,
}


# ---------------------------------------------------------------------------------------
# A prepared folder serves from any modules cache.
#
# transformers copies into its modules cache only modeling_qwen.py and the .py files it
# imports relatively (this module, and cpp_kernels.py: qwen-kvprep's loader), never the
# kernel sources the model looks for beside that copy, nor the fast path's module, which
# modeling_qwen.py imports by name. fix and prestart plant both into the modules cache of
# the environment they run in; a server started with another (a fresh HF_HOME, an emptyDir
# volume, another user, a read-only cache) would run the slow path. `_supply` writes
# nothing there: it registers the fast path's module from the prepared folder (the
# checkpoint the loader was rendered for), checked against the sha256 fix wrote into the
# loader, under its name in this package, where modeling_qwen.py's import then finds it;
# and it gives an attention layer whose kernel sources are absent here the extension from
# the loader itself, which needs no sources while the build cache holds its build. Where
# either cannot be, the load warns, naming the prepared folder and the command that
# prepares this environment; QWEN_KVPREP_STRICT=1 makes the load fail instead.

import ast  # noqa: E402  (this part's own imports, kept with it)
import functools  # noqa: E402
import hashlib  # noqa: E402
import importlib  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import stat  # noqa: E402
import types  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

STRICT_ENV = "QWEN_KVPREP_STRICT"
LOADER_FILE = "cpp_kernels.py"
FAST_FILE = "qwen_kvprep_kv.py"
KERNEL_SOURCES = ("cache_autogptq_cuda_256.cpp", "cache_autogptq_cuda_kernel_256.cu")
SOURCES_MISSING = "KV cache kernel source files (.cpp and .cu) not found."  # the model's warning
SUPPLIED = "_qwen_kvprep_supplied"  # set on QWenAttention once its __init__ is wrapped
_LOADER_MARK = "# qwen-kvprep loader"
_LOADER_VALUES = ("_CHECKPOINT", "_FIX", "_PRESTART", "_FAST_SHA256")
_READ_LIMIT = 4 << 20  # the loader and the fast path's module are a few tens of KB


class KvprepFallbackError(RuntimeError):
    """The load would fall back to the slow path, and QWEN_KVPREP_STRICT=1 forbids it."""


def strict():
    return os.environ.get(STRICT_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _read_regular(path):
    """A regular file's bytes (not through a link, not a FIFO that would block), bounded."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(str(path), flags)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError("%s is not a regular file" % path)
        if info.st_size > _READ_LIMIT:
            raise OSError("%s is larger than %d bytes" % (path, _READ_LIMIT))
        chunks, left = [], _READ_LIMIT + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _sha256_or_none(path):
    try:
        return hashlib.sha256(_read_regular(path)).hexdigest()
    except OSError:
        return None


def loader_values(folder):
    """What the loader beside this copy of the model's code says of the prepared folder
    (its literal assignments `_CHECKPOINT`, `_FIX`, `_PRESTART`, `_FAST_SHA256`), read
    without importing it (an import builds or loads the extension); None when the file
    there is not qwen-kvprep's loader."""
    try:
        text = _read_regular(Path(folder) / LOADER_FILE).decode("utf-8")
        if not any(line.startswith(_LOADER_MARK) for line in text.splitlines()[:5]):
            return None
        tree = ast.parse(text)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return None
    values = {}
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id in _LOADER_VALUES
        ):
            try:
                values[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                continue
    if not isinstance(values.get("_CHECKPOINT"), str):
        return None
    return values


def _advice(values):
    checkpoint = values["_CHECKPOINT"]
    prestart = values.get("_PRESTART") or "qwen-kvprep prestart %s -- CMD" % checkpoint
    fix = values.get("_FIX") or "qwen-kvprep fix %s" % checkpoint
    return "Run `%s` (CMD: your server command) or `%s` in this environment." % (prestart, fix)


def _supply(namespace):
    path = namespace.get("__file__")
    package = namespace.get("__package__")
    if not path or not package:
        return
    here = Path(path).parent
    values = loader_values(here)
    if values is None:  # not a folder fix prepared with its loader: nothing to supply from
        return
    _supply_fast_path(package, here, values)
    _supply_kernel(namespace, package, here)


class _Unavailable(types.ModuleType):
    """Stands in for the fast path's module that cannot be supplied: modeling_qwen.py's
    import of it then warns with the reason and the advice (or fails the load, strict)."""

    def __init__(self, name, message):
        super().__init__(name)
        self.message = message

    def install(self, namespace):
        if strict():
            raise KvprepFallbackError(
                "qwen-kvprep: %s (%s=1: the load fails instead)" % (self.message, STRICT_ENV)
            )
        raise ImportError(self.message)  # modeling_qwen.py warns "fast path is not loaded"


def _supply_fast_path(package, here, values):
    want = values.get("_FAST_SHA256")
    name = package + "." + FAST_FILE[:-3]
    if not isinstance(want, str) or name in sys.modules:
        return  # fix installed no fast path, or this process imported it already
    if _sha256_or_none(here / FAST_FILE) == want:
        return  # fix or prestart planted it here: the model's import finds it
    source = Path(values["_CHECKPOINT"]) / FAST_FILE
    try:
        data = _read_regular(source)
    except OSError as exc:
        why = "%s cannot be read (%s)" % (source, exc.strerror or exc)
    else:
        if hashlib.sha256(data).hexdigest() == want:
            module = types.ModuleType(name)
            module.__file__ = str(source)
            module.__package__ = package
            try:
                exec(compile(data, str(source), "exec"), module.__dict__)
            except ImportError as exc:
                why = "%s does not import here (%s)" % (source, exc)
            else:
                sys.modules[name] = module
                return
        else:
            why = "%s is not the version fix wrote (its sha256 differs)" % source
    message = (
        "the fast path's module %s of the prepared folder %s is neither in this modules"
        " cache (%s) nor usable from the folder: %s; so the model runs its own, slower Int8"
        " code. %s" % (FAST_FILE, values["_CHECKPOINT"], here, why, _advice(values))
    )
    sys.modules[name] = _Unavailable(name, message)


def _sources_here(here):
    return all((here / name).is_file() for name in KERNEL_SOURCES)


def _supply_kernel(namespace, package, here):
    attention = namespace.get("QWenAttention")
    if attention is None or getattr(attention, SUPPLIED, False):
        return
    own_init = attention.__init__

    @functools.wraps(own_init)
    def __init__(self, config, *args, **kwargs):
        wanted = getattr(config, "use_cache_quantization", False) and getattr(
            config, "use_cache_kernel", False
        )
        if not wanted or _sources_here(here):
            own_init(self, config, *args, **kwargs)
            return
        # The model finds no sources beside this copy and would warn that they are missing
        # (its warning names nothing to do); the loader serves without them, and warns
        # itself, naming the prepared folder, where it cannot. (Models are built in one
        # thread: the filter is this call's alone.)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=re.escape(SOURCES_MISSING))
            own_init(self, config, *args, **kwargs)
        if getattr(self, "cache_kernels", None) is None:
            try:
                loader = importlib.import_module("." + LOADER_FILE[:-3], package)
                self.cache_kernels = loader.cache_autogptq_cuda_256
            except ImportError:
                pass  # the loader warned (once per process), naming prestart and the folder

    attention.__init__ = __init__
    setattr(attention, SUPPLIED, True)
