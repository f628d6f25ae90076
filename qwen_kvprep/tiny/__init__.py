"""Tiny Qwen (v1) compatible checkpoints, for tests and `qwen-kvprep demo`.

`generate_checkpoint(dest)` writes a directory that looks and behaves like a Qwen v1 chat
checkpoint for everything qwen-kvprep touches, at a few MB and CPU speed:

    dest/
      config.json                  model_type "qwen", auto_map, bf16 flag, use_flash_attn
                                   "auto", no use_cache_* keys (like the original configs)
      configuration_qwen.py        \
      modeling_qwen.py              | our own remote code (REMOTE_CODE_DIR): same tensor
      tokenization_qwen.py          | names, precision resolution, Int8 KV cache, kernel
      qwen_generation_utils.py      | discovery and failure modes as docs/qwen-v1.md
      cpp_kernels.py               /  describes
      qwen.tiktoken                256 byte tokens + BPE merges learnt from a built-in text
      tokenizer_config.json        auto_map.AutoTokenizer
      generation_config.json       chatml defaults, eos/pad = <|endoftext|>
      model-0000N-of-0000M.safetensors + model.safetensors.index.json
                                   (shards=1: model.safetensors alone; legacy_bin=True:
                                   pytorch_model.bin alone)
      quantize_config.json         only with gptq=True: then the block linears are GPTQ
                                   Int4 tensors (qweight, qzeros, scales, g_idx; see
                                   tiny/gptq.py), everything else fp16, and config.json
                                   carries quantization_config, as Qwen's -Int4 repos
      cache_autogptq_cuda_256.cpp, cache_autogptq_cuda_kernel_256.cu
                                   only when kernel_sources is given

Knobs: layers, heads, head_dim (hidden = heads * head_dim; keep 128 with bf16 so one
token of one head costs 132 quantized bytes against 256), intermediate (Qwen convention:
twice the MLP width), vocab_merges, shards, dtype ("bf16", "fp16", "fp32", or "auto" for
none of the three flags set), seed (weights, and nothing else, depend on it),
config_overrides (merged last; the value REMOVE deletes a key). gptq=True writes an Int4
checkpoint (dtype fp16, the only one GPTQ models run in; the default then): loading it
needs a GPTQ backend (`pip install "qwen-kvprep[gptq]"`, see docs/reference.md).

The folder name is not checked: a dot in it (`qwen-7b-v1.0`) reproduces the module
import failure of docs/qwen-v1.md ("Checkpoint"), which tests may want.

Run `python -m qwen_kvprep.tiny DEST` to write one by hand.
"""

from __future__ import annotations

import base64
import json
import math
import shutil
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Union

from qwen_kvprep.common import KERNEL_FILES
from qwen_kvprep.errors import UsageError
from qwen_kvprep.jsontypes import JSON, JSONObject
from qwen_kvprep.tiny import gptq as _gptq

if TYPE_CHECKING:
    import torch

REMOTE_CODE_DIR = Path(__file__).resolve().parent / "remote"

REMOTE_FILES = (
    "configuration_qwen.py",
    "modeling_qwen.py",
    "tokenization_qwen.py",
    "qwen_generation_utils.py",
    "cpp_kernels.py",
)

DTYPES = ("bf16", "fp16", "fp32", "auto")

# Must match tokenization_qwen.py: the split before BPE, and the specials after the ranks.
PAT_STR = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
N_SPECIAL_TOKENS = 3 + 205  # endoftext, im_start, im_end, extra_0..extra_204


class _Remove:
    def __repr__(self) -> str:
        return "REMOVE"


REMOVE = _Remove()
"""Value for `config_overrides` that deletes the key from config.json."""

# The text the BPE merges are learnt from. Its content only shapes which merges exist;
# it is part of the checkpoint format, so changing it changes every tiny vocabulary.
_CORPUS = """\
You are a helpful assistant. The user asks a question and the assistant answers it.
Hello! How are you today? I am fine, thank you. What can I do for you?
Please tell me a story about a small model that learns to speak. Once upon a time there
was a tiny model with two layers and two heads. It lived in a temporary directory and
answered every question with a few random words, but it always answered quickly.
The key value cache stores the keys and the values of every token that the model has
seen, so that the next token does not have to recompute them. With the cache quantized
to eight bits, every key and every value costs one byte instead of two, plus a scale and
a zero point for each token and head. The kernel multiplies the query with the quantized
keys, and the attention probabilities with the quantized values, without dequantizing
them first. If the kernel is missing, the model falls back to the slower torch path.
What is the capital of France? The capital of France is Paris. What is two plus two?
Two plus two is four. Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 1024 2048 4096 8192.
Translate this sentence into another language, then summarize the result in one line.
def main(): print("hello world") return 0 # a small program in the python language
import torch; x = torch.zeros(2, 3); y = x + 1; print(y.shape, y.dtype, y.device)
The weather is nice today, the sun is shining and the birds are singing in the trees.
Thank you for your help. You are welcome, have a nice day and see you again soon.
"""


def _train_merges(n_merges: int) -> dict[bytes, int]:
    """Byte-level BPE ranks: the 256 bytes, then up to `n_merges` merges in learnt order."""
    import regex  # type: ignore[import-untyped]  # tiktoken depends on it

    ranks: dict[bytes, int] = {bytes([i]): i for i in range(256)}
    words = Counter(regex.findall(PAT_STR, _CORPUS))
    seqs = {w: [bytes([b]) for b in w.encode("utf-8")] for w in words}
    merges = 0
    while merges < n_merges:
        pairs: Counter[tuple[bytes, bytes]] = Counter()
        for w, count in words.items():
            parts = seqs[w]
            for a, b in zip(parts, parts[1:]):
                pairs[(a, b)] += count
        if not pairs:
            break
        # most frequent pair; ties broken by the pair itself so the result is stable
        best = min(pairs, key=lambda p: (-pairs[p], p))
        joined = best[0] + best[1]
        if joined not in ranks:
            ranks[joined] = len(ranks)
            merges += 1
        for w, parts in seqs.items():
            merged: list[bytes] = []
            i = 0
            while i < len(parts):
                if i + 1 < len(parts) and (parts[i], parts[i + 1]) == best:
                    merged.append(joined)
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            seqs[w] = merged
    return ranks


def _tiktoken_file(ranks: dict[bytes, int]) -> bytes:
    lines = [
        base64.b64encode(tok) + b" " + str(rank).encode()
        for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])
    ]
    return b"\n".join(lines) + b"\n"


def _config(
    *,
    layers: int,
    heads: int,
    head_dim: int,
    intermediate: int,
    vocab_size: int,
    dtype: str,
) -> JSONObject:
    hidden = heads * head_dim
    return {
        "architectures": ["QWenLMHeadModel"],
        "auto_map": {
            "AutoConfig": "configuration_qwen.QWenConfig",
            "AutoModelForCausalLM": "modeling_qwen.QWenLMHeadModel",
        },
        "attn_dropout_prob": 0.0,
        "bf16": dtype == "bf16",
        "emb_dropout_prob": 0.0,
        "fp16": dtype == "fp16",
        "fp32": dtype == "fp32",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": intermediate,
        "kv_channels": head_dim,
        "layer_norm_epsilon": 1e-06,
        "max_position_embeddings": 8192,
        "model_type": "qwen",
        "no_bias": True,
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "onnx_safe": None,
        "rotary_emb_base": 10000,
        "rotary_pct": 1.0,
        "scale_attn_weights": True,
        "seq_length": 8192,
        "tie_word_embeddings": False,
        "tokenizer_class": "QWenTokenizer",
        "transformers_version": "4.32.0",
        "use_cache": True,
        "use_dynamic_ntk": True,
        "use_flash_attn": "auto",
        "use_logn_attn": True,
        "vocab_size": vocab_size,
    }


# Weight design (see _weights). Tuned by measuring top-2 logit margins over 1,024
# random positions: with these values 0.6% of them are below 0.25 (the quantized
# cache moves logits by up to ~0.13), 2% below 1.0, the median is 4.7.
_BIGRAM = 1.0  # current token -> its successor
_PREV = 1.5  # previous token -> its trigger successor; more makes cross-talk win
_TRIGGER_FRACTION = 0.3
_NOISE = 0.3  # plain random part of every lm_head row
_SIDE = 0.15  # output scale of every other head and of the MLPs
_PREV_HEAD_PAIRS = 8  # fastest rotary pairs that carry the previous-token pattern
_PREV_HEAD_MARGIN = 16.0  # score(previous token) - score(any other token)


def _weights(
    *,
    layers: int,
    heads: int,
    head_dim: int,
    ff: int,
    vocab_size: int,
    n_tokens: int,
    dtype: str,
    seed: int,
) -> dict[str, torch.Tensor]:
    """Weights in Qwen's tensor names and order, deterministic from `seed`.

    Purely random weights make a model whose top-2 logits are so close that bf16
    rounding or the 8-bit cache flip greedy tokens often (measured: 1 sequence in 6
    within 16 tokens), so "quantized and unquantized cache agree" would mean little.
    Instead the next token is decided by two discrete terms with wide margins, one of
    which goes through the KV cache:

    - every ordinary token has a random successor (bigram, strength _BIGRAM);
    - layer 0 head 0 attends to the previous token: its query and key are constant
      (biases only) and rotary embedding turns them into a score that peaks at
      distance 1. Its value/output carry the previous token's embedding, and for a
      random 30% of "trigger" tokens the head predicts another successor with the
      larger strength _PREV. So about a third of the greedy tokens depend on the
      cached values of the previous position.

    Every other head and the MLPs are random with small outputs (_SIDE): they run
    the data-dependent paths (random queries against the quantized keys) and move
    the logits measurably, without deciding tokens. Special tokens and the padding
    rows of lm_head get no successor role, so greedy decoding keeps to ordinary text.

    Measured (seeds 0 and 1, 40 prompts x 16 greedy tokens each): quantized and
    unquantized cache agree on every sequence, and removing head 0 changes 23-36% of
    the tokens. Agreement is likely, not guaranteed: about 1 position in 1,000 is
    close enough to a tie for the 8-bit cache to flip it.
    """
    import torch

    hidden = heads * head_dim
    gen = torch.Generator().manual_seed(seed)

    def normal(shape: tuple[int, ...], std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std

    wte = normal((vocab_size, hidden), 1.0)
    tensors: dict[str, torch.Tensor] = {"transformer.wte.weight": wte}
    for i in range(layers):
        p = f"transformer.h.{i}."
        c_attn_w = normal((3 * hidden, hidden), 1.0 / math.sqrt(hidden))
        c_attn_b = normal((3 * hidden,), 0.1)
        c_proj = normal((hidden, hidden), _SIDE / math.sqrt(hidden))
        if i == 0:
            _previous_token_head(c_attn_w, c_attn_b, c_proj, head_dim, hidden, gen)
        tensors[p + "ln_1.weight"] = torch.ones(hidden)
        tensors[p + "attn.c_attn.weight"] = c_attn_w
        tensors[p + "attn.c_attn.bias"] = c_attn_b
        tensors[p + "attn.c_proj.weight"] = c_proj
        tensors[p + "ln_2.weight"] = torch.ones(hidden)
        tensors[p + "mlp.w1.weight"] = normal((ff, hidden), 1.0 / math.sqrt(hidden))
        tensors[p + "mlp.w2.weight"] = normal((ff, hidden), 1.0 / math.sqrt(hidden))
        tensors[p + "mlp.c_proj.weight"] = normal((hidden, ff), 2 * _SIDE / math.sqrt(ff))
    tensors["transformer.ln_f.weight"] = torch.ones(hidden)

    def unit(x: torch.Tensor) -> torch.Tensor:
        norm: torch.Tensor = x.norm(dim=-1, keepdim=True)  # Tensor.norm is unannotated
        return x / norm

    n_plain = n_tokens - N_SPECIAL_TOKENS
    # what layer 0 reads (ln_1 of the embedding) and what head 0 writes for it
    x = wte[:n_plain] / wte[:n_plain].pow(2).mean(-1, keepdim=True).sqrt()
    value = x @ tensors["transformer.h.0.attn.c_attn.weight"][2 * hidden : 2 * hidden + head_dim].T
    head_out = value @ tensors["transformer.h.0.attn.c_proj.weight"][:, :head_dim].T

    lm_head = torch.zeros((vocab_size, hidden))
    lm_head[:n_tokens] = normal((n_tokens, hidden), _NOISE / math.sqrt(hidden))
    successor = torch.randperm(n_plain, generator=gen)
    lm_head[successor] += _BIGRAM * unit(wte[:n_plain])
    n_trigger = int(_TRIGGER_FRACTION * n_plain)
    triggers = torch.randperm(n_plain, generator=gen)[:n_trigger]
    targets = torch.randperm(n_plain, generator=gen)[:n_trigger]
    lm_head[targets] += _PREV * unit(head_out[triggers])
    # rows past the tokenizer's vocabulary (padding to a multiple of 128) stay 0, far
    # below the winners: greedy decoding never emits an id the tokenizer lacks
    tensors["lm_head.weight"] = lm_head

    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    # "auto" checkpoints are stored in bf16, like the original Qwen releases
    target = torch_dtype.get(dtype, torch.bfloat16)
    return {k: v.to(target).contiguous() for k, v in tensors.items()}


def _previous_token_head(
    c_attn_w: torch.Tensor,
    c_attn_b: torch.Tensor,
    c_proj: torch.Tensor,
    head_dim: int,
    hidden: int,
    gen: torch.Generator,
) -> None:
    """Turns head 0 of a layer into "attend to the previous position" (in place).

    Query and key are constant (weights 0, biases only) on the fastest rotary pairs;
    the key is the query rotated by one position's angle, so after rotary embedding
    q_m . k_n = sum_i a^2 cos((m - n - 1) * theta_i), largest at m - n = 1. Over the
    first 2048 distances the runner-up reaches at most 0.8 of the peak with 8 pairs,
    and the scale a is set for a score margin of _PREV_HEAD_MARGIN.
    """
    import torch

    half = head_dim // 2
    pairs = min(_PREV_HEAD_PAIRS, half)
    theta = 10000.0 ** (-2.0 * torch.arange(pairs, dtype=torch.float32) / head_dim)
    a = math.sqrt(_PREV_HEAD_MARGIN * math.sqrt(head_dim) / (0.2 * pairs))
    q = slice(0, head_dim)
    k = slice(hidden, hidden + head_dim)
    v = slice(2 * hidden, 2 * hidden + head_dim)
    c_attn_w[q] = 0.0
    c_attn_w[k] = 0.0
    c_attn_b[q] = 0.0
    c_attn_b[k] = 0.0
    c_attn_b[v] = 0.0
    c_attn_b[q.start : q.start + pairs] = a
    c_attn_b[k.start : k.start + pairs] = a * torch.cos(theta)
    c_attn_b[k.start + half : k.start + half + pairs] = a * torch.sin(theta)
    # value: the layer input itself (RMS 1 per element), written back at full scale
    c_attn_w[v] = torch.randn((head_dim, hidden), generator=gen) / math.sqrt(hidden)
    c_proj[:, :head_dim] = torch.randn((hidden, head_dim), generator=gen) / math.sqrt(head_dim)


def _shard(names: list[str], sizes: dict[str, int], shards: int) -> list[list[str]]:
    """`shards` consecutive, non-empty groups of roughly equal byte size."""
    total = sum(sizes.values())
    groups: list[list[str]] = [[]]
    done = 0
    for idx, name in enumerate(names):
        still_to_open = shards - len(groups)
        if groups[-1] and still_to_open > 0 and (
            done >= total * len(groups) / shards or len(names) - idx <= still_to_open
        ):
            groups.append([])
        groups[-1].append(name)
        done += sizes[name]
    return groups


def _write_json(path: Path, data: JSONObject) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def generate_checkpoint(
    dest: Path,
    *,
    layers: int = 2,
    heads: int = 2,
    head_dim: int = 128,
    intermediate: int = 512,
    vocab_merges: int = 256,
    shards: int = 2,
    dtype: Optional[str] = None,
    seed: int = 0,
    legacy_bin: bool = False,
    gptq: bool = False,
    kernel_sources: Optional[Path] = None,
    config_overrides: Optional[Mapping[str, Union[JSON, _Remove]]] = None,
) -> Path:
    """Write a tiny Qwen v1 checkpoint into `dest` (created; must be absent or empty).

    Returns `dest`. Raises UsageError for bad knobs, a non-empty `dest`, or a
    `kernel_sources` folder that lacks one of the two kernel files. `dtype` defaults to
    "bf16", and to "fp16" (the only one allowed) with gptq=True.
    """
    dest = Path(dest)
    if dtype is None:
        dtype = "fp16" if gptq else "bf16"
    if dtype not in DTYPES:
        raise UsageError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    if gptq and dtype != "fp16":
        # transformers loads GPTQ checkpoints in fp16, as Qwen's Int4 configs say (fp16: true)
        raise UsageError(f"a GPTQ checkpoint runs in fp16, not {dtype}: leave dtype unset")
    if layers < 1 or heads < 1 or head_dim < 2 or head_dim % 2 or intermediate < 2:
        raise UsageError("layers, heads >= 1; head_dim even >= 2; intermediate >= 2")
    if vocab_merges < 0:
        raise UsageError("vocab_merges must be >= 0")
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise UsageError(f"{dest} exists and is not an empty directory")
    sources: list[Path] = []
    if kernel_sources is not None:
        sources = [Path(kernel_sources) / name for name in KERNEL_FILES]
        missing = [str(p) for p in sources if not p.is_file()]
        if missing:
            raise UsageError(f"kernel_sources lacks {', '.join(missing)}")

    ranks = _train_merges(vocab_merges)
    if len(ranks) - 256 < vocab_merges:
        raise UsageError(f"vocab_merges: the built-in text yields at most {len(ranks) - 256}")
    n_tokens = len(ranks) + N_SPECIAL_TOKENS
    eod_id = len(ranks)
    vocab_size = 128 * math.ceil(n_tokens / 128)

    config = _config(
        layers=layers,
        heads=heads,
        head_dim=head_dim,
        intermediate=intermediate,
        vocab_size=vocab_size,
        dtype=dtype,
    )
    if gptq:
        config["quantization_config"] = dict(_gptq.QUANTIZE_CONFIG, quant_method="gptq")
        hidden = heads * head_dim
        _gptq.check_shape("attn.c_attn", 3 * hidden, hidden)
        _gptq.check_shape("mlp.c_proj", hidden, intermediate // 2)
    for key, value in (config_overrides or {}).items():
        if isinstance(value, _Remove):  # REMOVE, its only instance
            config.pop(key, None)
        else:
            config[key] = value

    tensors = _weights(
        layers=layers,
        heads=heads,
        head_dim=head_dim,
        ff=intermediate // 2,
        vocab_size=vocab_size,
        n_tokens=n_tokens,
        dtype=dtype,
        seed=seed,
    )
    if gptq:
        tensors = _gptq.quantize_tensors(tensors)

    dest.mkdir(parents=True, exist_ok=True)
    _write_json(dest / "config.json", config)
    for name in REMOTE_FILES:
        shutil.copyfile(REMOTE_CODE_DIR / name, dest / name)
    (dest / "qwen.tiktoken").write_bytes(_tiktoken_file(ranks))
    _write_json(
        dest / "tokenizer_config.json",
        {
            "model_max_length": 8192,
            "tokenizer_class": "QWenTokenizer",
            "auto_map": {"AutoTokenizer": ["tokenization_qwen.QWenTokenizer", None]},
        },
    )
    _write_json(
        dest / "generation_config.json",
        {
            "chat_format": "chatml",
            "eos_token_id": eod_id,
            "pad_token_id": eod_id,
            "max_window_size": 6144,
            "max_new_tokens": 512,
            "do_sample": True,
            "top_k": 0,
            "top_p": 0.8,
            "repetition_penalty": 1.1,
            "transformers_version": "4.32.0",
        },
    )
    _write_weights(dest, tensors, shards=shards, legacy_bin=legacy_bin)
    if gptq:
        _write_json(dest / "quantize_config.json", dict(_gptq.QUANTIZE_CONFIG))
    for src in sources:
        shutil.copyfile(src, dest / src.name)
    return dest


def _write_weights(
    dest: Path, tensors: dict[str, torch.Tensor], *, shards: int, legacy_bin: bool
) -> None:
    import torch

    if legacy_bin:
        torch.save(tensors, dest / "pytorch_model.bin")
        return
    from safetensors.torch import save_file

    names = list(tensors)
    if shards <= 1:
        # what save_pretrained writes for a small model: one file, no index
        save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
        (dest / "model.safetensors").chmod(0o644)
        return
    shards = min(shards, len(names))
    sizes = {n: tensors[n].numel() * tensors[n].element_size() for n in names}
    weight_map: dict[str, str] = {}
    for i, group in enumerate(_shard(names, sizes, shards), start=1):
        fname = f"model-{i:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in group}, str(dest / fname), metadata={"format": "pt"})
        # safetensors creates 0600 files; downloaded checkpoints are world-readable
        (dest / fname).chmod(0o644)
        weight_map.update({n: fname for n in group})
    index: JSONObject = {
        "metadata": {"total_size": sum(sizes.values())},
        "weight_map": dict(sorted(weight_map.items())),
    }
    _write_json(dest / "model.safetensors.index.json", index)
