"""What `plan` needs to know about a checkpoint: its shape, its load dtype, its weight bytes.

Read from config.json and the safetensors headers only (never tensor data). Where the
shards are not there -- a git checkout without LFS leaves pointer files, a config-only
folder has none -- the index's `metadata.total_size` stands in for them, and without an
index the weights are counted from config.json, tensor by tensor, as the Qwen (v1)
remote code creates them.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from qwen_kvprep import hubcli
from qwen_kvprep.configjson import CONFIG, parse_config_bytes, read_config_bytes
from qwen_kvprep.errors import CheckpointError, ConfigError, UsageError
from qwen_kvprep.gptqconfig import IN_CONFIG, is_gptq, parse, read_quantize_config
from qwen_kvprep.jsontypes import JSON, JSONObject
from qwen_kvprep.planning.peak import ModelShape
from qwen_kvprep.probe.checkpoint import (
    BIN_INDEX,
    DTYPE_SIZES,
    QUANTIZE_CONFIG,
    ST_INDEX,
    ST_SINGLE,
    IndexFacts,
    ShardFacts,
    hub_snapshot,
    probe_index,
    probe_shard,
    sniff,
)

DTYPE_BYTES: Mapping[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4}

# Floating safetensors dtypes: the loader casts them to the model's dtype, so they are
# priced at that dtype. Integer tensors (GPTQ's qweight, qzeros, g_idx) stay as stored.
_FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})

# QWenConfig's default when config.json omits kv_channels.
_DEFAULT_KV_CHANNELS = 128


@dataclass(frozen=True)
class Gptq:
    bits: int
    group_size: int  # -1: one group spanning the whole input dimension


@dataclass(frozen=True)
class ModelFacts:
    """Everything plan reads from a checkpoint directory: the shape the prediction takes,
    and where each part came from."""

    path: Path
    shape: ModelShape
    dtype: str  # "bf16" | "fp16" | "fp32"
    dtype_source: str
    weights_source: str
    gptq: Optional[Gptq]
    softmax_in_fp32: bool
    seq_length: Optional[int]
    max_position_embeddings: Optional[int]

    def to_json(self) -> JSONObject:
        """The "model" object of `plan --json`."""
        s = self.shape
        gptq: JSON = (
            None if self.gptq is None
            else {"bits": self.gptq.bits, "group_size": self.gptq.group_size}
        )
        return {
            "layers": s.layers,
            "heads": s.heads,
            "head_dim": s.head_dim,
            "hidden": s.hidden,
            "intermediate": s.intermediate,
            "vocab": s.vocab,
            "dtype": self.dtype,
            "gptq": gptq,
            "seq_length": self.seq_length,
            "max_position_embeddings": self.max_position_embeddings,
        }


def _fix_config(path: Path, name: str = CONFIG) -> str:
    repo, _, _ = hub_snapshot(path)
    where = shlex.quote(str(path))
    repo = repo or "<repo, e.g. Qwen/Qwen-7B-Chat>"
    return f"{hubcli.download()} {repo} {name} --local-dir {where}"


def _doctor(path: Path) -> str:
    return (
        f"qwen-kvprep doctor {shlex.quote(str(path))}  (names the broken files and the command "
        "that re-fetches them)"
    )


def read_config(path: Path) -> JSONObject:
    config_path = path / CONFIG
    if not os.path.lexists(config_path):
        raise CheckpointError(
            f"{path} has no {CONFIG}: plan needs it for the model's shape",
            fix=_fix_config(path),
        )
    # bounded, regular files only (a FIFO would block the read forever), as fix reads it
    raw = read_config_bytes(config_path)
    problem = sniff(CONFIG, raw[:1024], len(raw))
    if problem is not None:
        raise ConfigError(f"{config_path} {problem.detail}", fix=_fix_config(path))
    # strict UTF-8, as fix and doctor read it: a stray byte is named, not shown as mojibake
    return dict(parse_config_bytes(raw, config_path))


def _positive_int(config: Mapping[str, JSON], key: str, path: Path) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(
            f"{path / CONFIG} has no valid {key!r} (a positive integer; found {value!r})",
            fix=f"restore the original {CONFIG}: {_fix_config(path)}",
        )
    return value


def _optional_int(config: Mapping[str, JSON], key: str) -> Optional[int]:
    value = config.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def resolve_dtype(
    config: Mapping[str, JSON], requested: Optional[str], gptq: bool
) -> tuple[str, str]:
    """(dtype, why) as QWenLMHeadModel resolves it, unless `requested` overrides it."""
    if requested is not None:
        if requested not in DTYPE_BYTES:
            raise UsageError(
                f"unknown dtype {requested!r}", fix=f"use one of {', '.join(DTYPE_BYTES)}"
            )
        return requested, "--dtype"
    flags = [name for name in ("bf16", "fp16", "fp32") if config.get(name) is True]
    if len(flags) > 1:
        # the remote code refuses this config at load time; so do we
        raise ConfigError(
            f"config.json sets {' and '.join(flags)} true: the Qwen remote code allows one",
            fix="set only one of bf16/fp16/fp32 to true in config.json",
        )
    if flags:
        return flags[0], f"config.json {flags[0]}: true"
    if gptq:
        return "fp16", "GPTQ checkpoints run in fp16"
    # none set: the remote code picks bf16 where the GPU supports it (Ampere and newer)
    return "bf16", "none of bf16/fp16/fp32 set: bf16, as the remote code picks on a GPU with bf16"


def read_gptq(path: Path, config: Mapping[str, JSON]) -> Optional[Gptq]:
    """The GPTQ parameters from config.json's quantization_config (what transformers reads)
    or else quantize_config.json, judged by the grammar doctor and fix use."""
    qc: JSON = config.get("quantization_config")
    where, name = IN_CONFIG, CONFIG
    if not (isinstance(qc, dict) and is_gptq(qc)):
        if not (path / QUANTIZE_CONFIG).is_file():
            return None
        qfile = read_quantize_config(path / QUANTIZE_CONFIG)
        if qfile.data is None:
            raise ConfigError(
                f"{path / QUANTIZE_CONFIG} {qfile.error}", fix=_fix_config(path, QUANTIZE_CONFIG)
            )
        qc, where, name = qfile.data, QUANTIZE_CONFIG, QUANTIZE_CONFIG
    parsed, problems = parse(qc, where)
    if parsed is None:
        raise ConfigError("; ".join(problems), fix=_fix_config(path, name))
    return Gptq(bits=parsed.bits, group_size=parsed.group_size)


# -- weights -------------------------------------------------------------------------------


def weights_from_config(
    *,
    layers: int,
    heads: int,
    head_dim: int,
    hidden: int,
    intermediate: int,
    vocab: int,
    dtype_bytes: int,
    no_bias: bool,
    gptq: Optional[Gptq],
) -> int:
    """Bytes of every tensor QWenLMHeadModel holds, counted from the config alone.

    Per block: ln_1, ln_2 (hidden), attn.c_attn (hidden -> 3 * heads * head_dim, always with
    a bias), attn.c_proj, mlp.w1, mlp.w2 (hidden -> intermediate // 2) and mlp.c_proj (back);
    plus wte and an untied lm_head (vocab x hidden) and ln_f. The biases of the other
    projections exist only when no_bias is false. GPTQ replaces the block projections by
    qweight (int32, `bits` per weight), qzeros (int32), scales and g_idx; wte, lm_head
    and the norms stay in the model's dtype.
    """
    proj = heads * head_dim
    ff = intermediate // 2
    # (in, out, has_bias) of each projection in a block
    linears = [
        (hidden, 3 * proj, True),
        (proj, hidden, not no_bias),
        (hidden, ff, not no_bias),
        (hidden, ff, not no_bias),
        (ff, hidden, not no_bias),
    ]
    per_block = 2 * hidden * dtype_bytes  # ln_1, ln_2
    for n_in, n_out, bias in linears:
        per_block += n_out * dtype_bytes if bias else 0
        if gptq is None:
            per_block += n_in * n_out * dtype_bytes
            continue
        groups = 1 if gptq.group_size == -1 else -(-n_in // gptq.group_size)
        per_block += (n_in // 32 * gptq.bits) * n_out * 4  # qweight, int32
        per_block += groups * (n_out // 32 * gptq.bits) * 4  # qzeros, int32
        per_block += groups * n_out * dtype_bytes  # scales
        per_block += n_in * 4  # g_idx, int32
    embeddings = 2 * vocab * hidden * dtype_bytes  # wte and lm_head (not tied in Qwen v1)
    return embeddings + layers * per_block + hidden * dtype_bytes  # + ln_f


def _shard_bytes(shard: ShardFacts, dtype_bytes: int) -> int:
    return sum(
        numel * (dtype_bytes if dtype in _FLOAT_DTYPES else DTYPE_SIZES[dtype])
        for dtype, numel in shard.dtype_numel.items()
    )


def _present(path: Path, name: str) -> bool:
    """True when `name` holds real content; False when it is absent or an LFS pointer (a
    checkout without LFS). Any other stand-in (an HTML page, an empty file) is an error:
    the checkout is broken, not merely partial."""
    file = path / name
    if not file.is_file():
        return False
    try:
        size = os.stat(file).st_size
        with open(file, "rb") as fh:
            head = fh.read(1024)
    except OSError as exc:
        raise CheckpointError(
            f"{name} cannot be read: {exc.strerror or exc}", fix=_doctor(path)
        ) from exc
    problem = sniff(name, head, size)
    if problem is None:
        return True
    if problem.kind == "lfs-pointer":
        return False
    raise CheckpointError(f"{name} {problem.detail}", fix=_doctor(path))


def _headers(path: Path, names: list[str], dtype_bytes: int) -> int:
    total = 0
    for name in names:
        shard = probe_shard(path / name, name)
        if shard.error is not None:
            raise CheckpointError(f"{name} {shard.error}", fix=_doctor(path))
        total += _shard_bytes(shard, dtype_bytes)
    return total


def _index(path: Path, name: str) -> IndexFacts:
    index = probe_index(path, name)
    if index.error is not None:
        raise CheckpointError(f"{name} {index.error}", fix=_doctor(path))
    if index.refused:
        bad, why = index.refused[0]
        raise CheckpointError(
            f"{name} names {bad!r}, which {why}; plan does not open it", fix=_doctor(path)
        )
    return index


def weights_on_disk(path: Path, dtype_bytes: int) -> Optional[tuple[int, str]]:
    """(bytes, source) from the weight files or their index; None when neither is there.

    The same order of preference as transformers: model.safetensors, its index, then the
    pytorch_model.bin index (a .bin cannot be sized without unpickling it).
    """
    if _present(path, ST_SINGLE):
        return _headers(path, [ST_SINGLE], dtype_bytes), f"{ST_SINGLE} header"
    if (path / ST_INDEX).is_file():
        index = _index(path, ST_INDEX)
        present = [f for f in index.files if _present(path, f)]
        if len(present) == len(index.files):
            n = len(index.files)
            return _headers(path, present, dtype_bytes), f"safetensors headers of {n} files"
        if index.total_size is not None:
            # a stand-in that is a file here is a Git LFS pointer (_present refuses others)
            pointers = [f for f in index.files if f not in present and (path / f).is_file()]
            absent = len(index.files) - len(present) - len(pointers)
            n = len(index.files)
            gaps = [f"{len(pointers)} of {n} shards are Git LFS pointers (`git lfs pull` "
                    "fetches them)"] if pointers else []
            gaps += [f"{absent} of {n} shards absent"] if absent else []
            return index.total_size, f"{ST_INDEX} metadata.total_size; {', '.join(gaps)}"
    if (path / BIN_INDEX).is_file():
        index = _index(path, BIN_INDEX)
        if index.total_size is not None:
            return index.total_size, f"{BIN_INDEX} metadata.total_size"
    return None


def read_model(path: Path, dtype: Optional[str] = None) -> ModelFacts:
    """Shape, dtype and weight bytes of the checkpoint in `path`; KvprepError on bad input."""
    path = Path(path)
    if not path.is_dir():
        raise UsageError(f"no such directory: {path}")
    config = read_config(path)
    model_type = config.get("model_type")
    if model_type != "qwen":
        raise ConfigError(
            f"{path / CONFIG} has model_type {model_type!r}: plan models Qwen (v1) "
            "checkpoints (model_type 'qwen') only",
            fix="point plan at a Qwen (v1) checkpoint such as Qwen/Qwen-7B-Chat",
        )
    layers = _positive_int(config, "num_hidden_layers", path)
    heads = _positive_int(config, "num_attention_heads", path)
    hidden = _positive_int(config, "hidden_size", path)
    intermediate = _positive_int(config, "intermediate_size", path)
    vocab = _positive_int(config, "vocab_size", path)
    head_dim = (
        _positive_int(config, "kv_channels", path)
        if "kv_channels" in config
        else _DEFAULT_KV_CHANNELS
    )
    gptq = read_gptq(path, config)
    dtype_name, dtype_source = resolve_dtype(config, dtype, gptq is not None)
    dtype_bytes = DTYPE_BYTES[dtype_name]
    found = weights_on_disk(path, dtype_bytes)
    dims = {
        "layers": layers,
        "heads": heads,
        "head_dim": head_dim,
        "hidden": hidden,
        "intermediate": intermediate,
        "vocab": vocab,
        "dtype_bytes": dtype_bytes,
    }
    if found is None:
        no_bias = bool(config.get("no_bias", True))
        weights = weights_from_config(**dims, no_bias=no_bias, gptq=gptq)
        source = f"counted from {CONFIG}: no weight files or index in the folder"
    else:
        weights, source = found
    shape = ModelShape(
        **dims, weights_bytes=weights, gptq_bits=gptq.bits if gptq is not None else None
    )
    return ModelFacts(
        path=path,
        shape=shape,
        dtype=dtype_name,
        dtype_source=dtype_source,
        weights_source=source,
        gptq=gptq,
        softmax_in_fp32=config.get("softmax_in_fp32") is True,
        seq_length=_optional_int(config, "seq_length"),
        max_position_embeddings=_optional_int(config, "max_position_embeddings"),
    )


def model_shape(checkpoint: Path, dtype: Optional[str] = None) -> ModelShape:
    """From config.json and the safetensors headers (or the index's metadata.total_size
    when the shards are absent; or, with neither, counted from config.json). Never reads
    tensor data. Raises KvprepError subclasses with a fix hint on bad input."""
    return read_model(Path(checkpoint), dtype).shape
