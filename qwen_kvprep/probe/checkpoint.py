"""Probe a checkpoint directory: what it holds, and whether each file is what it claims.

Rules this module keeps:
- it never changes anything and never raises for a broken checkpoint: every problem
  becomes a fact, so `doctor` can report all of them at once;
- it never reads weights: safetensors shards are judged by their header alone (the first
  8 + N bytes), so an 82-shard 72B checkpoint is probed in milliseconds;
- a file name taken from the weight index that is absolute or climbs out with `..` is
  recorded as refused and never opened, not even stat'ed.
"""

from __future__ import annotations

import base64
import binascii
import errno
import importlib.util
import json
import os
import re
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import TYPE_CHECKING, NamedTuple, Optional, TypedDict, Union

from qwen_kvprep import compat, gptqconfig, provenance
from qwen_kvprep.common import (
    COMPAT_FILE,
    FAST_FILE,
    KERNEL_FILES,
    LOADER_MARKER,
    fix_command,
    sha256_bytes,
    sha256_file,
)
from qwen_kvprep.common import LOADER_FILE as LOADER
from qwen_kvprep.configjson import CONFIG, parse_config_bytes, read_config_bytes
from qwen_kvprep.errors import ConfigError, current_user
from qwen_kvprep.fastkv import is_patched, recognise, render_module
from qwen_kvprep.gptqconfig import PACKED, QuantizeFile, read_quantize_config
from qwen_kvprep.hubcache import repo_folder
from qwen_kvprep.probe.caches import folder_access
from qwen_kvprep.probe.env import IMPORT_TO_KNOW, import_error
from qwen_kvprep.probe.supply import serves_any_modules_cache
from qwen_kvprep.resources import templates_dir
from qwen_kvprep.untrusted import json_error_at, kind_of, open_regular, read_prefix

if TYPE_CHECKING:
    from typing import TypeGuard

    from qwen_kvprep.jsontypes import JSON

REMOTE_CODE_FILES = (
    "configuration_qwen.py",
    "modeling_qwen.py",
    "qwen_generation_utils.py",
    "tokenization_qwen.py",
    "cpp_kernels.py",
)
MODELING = "modeling_qwen.py"
TIKTOKEN = "qwen.tiktoken"
TOKENIZER_CONFIG = "tokenizer_config.json"
TOKENIZER_FILES = (TIKTOKEN, TOKENIZER_CONFIG)
GENERATION_CONFIG = "generation_config.json"
QUANTIZE_CONFIG = gptqconfig.QUANTIZE_CONFIG
ST_SINGLE = "model.safetensors"
ST_INDEX = "model.safetensors.index.json"
BIN_SINGLE = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"

# The safetensors library refuses headers above 100 MB (HeaderTooLarge); so do we.
MAX_HEADER = 100_000_000


def safetensors_symptom(old: str, new: str) -> str:
    """The error safetensors raises, in its older (enum name) and newer (text) spelling."""
    return (
        f"`SafetensorError: Error while deserializing header: {old}` (newer safetensors: "
        f"`{new}`)"
    )


ST_TOO_LARGE = safetensors_symptom("HeaderTooLarge", "header too large")
ST_TOO_SMALL = safetensors_symptom("HeaderTooSmall", "header too small")
ST_INCOMPLETE = safetensors_symptom(
    "MetadataIncompleteBuffer", "incomplete metadata, file not fully covered"
)

# Bytes per element of each safetensors dtype (Qwen v1 uses BF16/F16/F32 and, in the GPTQ
# variants, I32; the others are listed so that a valid foreign shard is not misjudged).
DTYPE_SIZES: Mapping[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip

# Files whose content is checked for LFS pointers / HTML pages / emptiness.
_CONTENT_SUFFIXES = (".json", ".py", ".tiktoken", ".safetensors", ".bin", ".cpp", ".cu")
_SNIFF_BYTES = 1024
_LFS_MAGIC = b"version https://git-lfs.github.com/spec/v1"
_HUB_DIR = re.compile(r"^models--(.+)$")


@dataclass(frozen=True)
class ContentProblem:
    """A file that is not what its name promises."""

    name: str  # relative to the checkpoint
    kind: str  # "lfs-pointer" | "html" | "empty" | "invalid-json" | "too-large" | "unreadable"
    detail: str  # completes "<name> ..." as a sentence fragment


@dataclass(frozen=True)
class ShardFacts:
    """A safetensors file judged from its header alone."""

    name: str
    size: Optional[int] = None
    header_len: Optional[int] = None
    tensor_names: frozenset[str] = frozenset()
    tensor_bytes: int = 0  # sum over tensors of numel * dtype size
    # elements per safetensors dtype: `plan` re-prices floating tensors at the dtype the
    # model is loaded in (a F32 checkpoint loaded in bf16 takes half its file size)
    dtype_numel: Mapping[str, int] = field(default_factory=dict)
    error: Optional[str] = None  # completes "<name> ..."
    truncated: bool = False  # the file ends before its header says it does
    # the shapes of GPTQ's packed tensors (`*.qweight`, `*.qzeros`, `*.scales`, `*.g_idx`)
    gptq_shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class IndexFacts:
    """model.safetensors.index.json (or pytorch_model.bin.index.json)."""

    name: str
    error: Optional[str] = None  # why it could not be used at all
    weight_map: Mapping[str, str] = field(default_factory=dict)  # tensor -> file, safe names only
    files: tuple[str, ...] = ()  # distinct safe file names, sorted
    refused: tuple[tuple[str, str], ...] = ()  # (name, reason): never opened
    missing: tuple[str, ...] = ()  # safe names that do not exist
    total_size: Optional[int] = None  # metadata.total_size when it is an int


@dataclass(frozen=True)
class CheckpointFacts:
    path: Path
    name: str
    spelt: Optional[str] = None  # the path as the user wrote it (doctor DIR), when known
    listing_error: Optional[str] = None
    files: tuple[str, ...] = ()  # top-level regular files (symlinks followed), sorted
    provenance_ours: bool = False  # provenance.json is here and says convert wrote it
    dangling: tuple[str, ...] = ()  # top-level symlinks whose target is gone
    special: tuple[tuple[str, str], ...] = ()  # (name, what): FIFOs, sockets, devices
    config: Optional[dict[str, JSON]] = None
    config_error: Optional[str] = None
    config_error_line: Optional[int] = None  # where the JSON parser stopped
    # what transformers itself does with the config.json refused, where that was checked
    # (4.32.1, 4.37.2, 4.53.3): "json" (a syntax error or bytes that are not UTF-8: `OSError:
    # ... not a valid JSON file`), "digits" (an integer over Python's 4300 digits: the same
    # ValueError), "size" (over qwen-kvprep's limit: transformers loads it); None: unchecked
    config_error_kind: Optional[str] = None
    config_is_symlink: bool = False
    config_link_target: Optional[str] = None
    modeling_text_supports_kv: Optional[bool] = None  # None: modeling_qwen.py unreadable
    # where modeling_qwen.py is not UTF-8 ("byte 0xe9 at line 926"): transformers reads the
    # model code as UTF-8 and fails on it (None: it is, or it cannot be read)
    modeling_not_utf8: Optional[str] = None
    modeling_mentions_kernel: Optional[bool] = None
    # the Int8 cache's fast path (fastkv.py): why this modeling_qwen.py is not one it applies
    # to (None: it is), whether fix's block is in it, and the planted module's sha256
    fast_path_problem: Optional[str] = None
    fast_path_imported: bool = False
    fast_module_sha256: Optional[str] = None
    fast_module_current: bool = False  # the one this qwen-kvprep installs
    compat_imported: bool = False  # modeling_qwen.py imports qwen_kvprep_compat.py
    compat_module_sha256: Optional[str] = None
    compat_module_current: bool = False  # the one this qwen-kvprep writes
    # a load from a modules cache fix never prepared gets the kernel and the fast path
    # from the folder itself (probe/supply.py)
    serves_any_modules_cache: bool = False
    remote_code: dict[str, Optional[str]] = field(default_factory=dict)  # name -> sha256
    gptq: bool = False
    gptq_source: Optional[str] = None
    quantize_config: Optional[QuantizeFile] = None  # None: there is no quantize_config.json
    weights_layout: str = "none"
    weight_files: tuple[str, ...] = ()
    index: Optional[IndexFacts] = None
    shards: tuple[ShardFacts, ...] = ()
    content_problems: tuple[ContentProblem, ...] = ()
    tiktoken_ranks: Optional[int] = None
    tiktoken_error: Optional[str] = None
    tiktoken_bad_line: Optional[int] = None
    kernel_sources: dict[str, Optional[str]] = field(default_factory=dict)
    loader_sha256: Optional[str] = None
    loader_is_ours: bool = False
    repo_id: Optional[str] = None
    revision: Optional[str] = None
    hub_cache_dir: Optional[Path] = None  # the huggingface_hub cache root holding the snapshot
    is_git_checkout: bool = False
    git_root: Optional[Path] = None  # the work tree holding it (its own .git or a parent's)
    requirements: tuple[str, ...] = ()  # top-level modules the remote code imports
    missing_requirements: tuple[str, ...] = ()  # of those, the ones that cannot be imported
    # the same once fix has run: its compatibility lines take chat_stream's import of
    # transformers_stream_generator out of transformers' check (equal for a fixed folder)
    fixed_requirements: tuple[str, ...] = ()
    fixed_missing: tuple[str, ...] = ()
    # the folder is a huggingface_hub cache repo folder (models--ORG--NAME with snapshots/):
    # its repo id, the snapshot folders in it and what its refs/ name (ref, commit)
    cache_repo: Optional[str] = None
    cache_snapshots: tuple[str, ...] = ()
    cache_refs: tuple[tuple[str, str], ...] = ()
    # why fix cannot write in the folder (a read-only file system, not this user's); None:
    # it can. Advice then prepares a view of it elsewhere (`fix -o OUT DIR`).
    read_only: Optional[str] = None

    @property
    def fix_command(self) -> str:
        """`qwen-kvprep fix DIR`, or `fix -o OUT DIR` for a folder fix cannot write."""
        return fix_command(self.path, self.read_only is not None)

    @property
    def dotted_name(self) -> bool:
        return "." in self.name

    def problem(self, name: str) -> Optional[ContentProblem]:
        for p in self.content_problems:
            if p.name == name:
                return p
        return None


# -- small readers that never raise --------------------------------------------------------


# Remote code and tokenizer configs are tens of KiB; a text file is never read past this.
TEXT_LIMIT = 16 << 20
# qwen.tiktoken is 2.5 MB; its check reads at most this much of it.
TIKTOKEN_PREFIX = 8 << 20


def _read_head(path: Path, size: int) -> bytes:
    return read_prefix(path, size)[0]


def _sha256(path: Path) -> Optional[str]:
    try:
        return sha256_file(path)
    except OSError:
        return None


def _not_utf8(path: Path) -> Optional[str]:
    """Where the file at `path` stops being UTF-8 (None: it is, or it cannot be read)."""
    try:
        raw = read_prefix(path, TEXT_LIMIT)[0]
        raw.decode("utf-8")
    except OSError:
        return None
    except UnicodeDecodeError as exc:
        if exc.start >= len(raw) - 3 and len(raw) == TEXT_LIMIT:
            return None  # a character cut at the limit: not a fault of the file
        line = raw.count(b"\n", 0, exc.start) + 1
        return f"byte 0x{raw[exc.start]:02x} at line {line}"
    return None


def _read_text(path: Path) -> Optional[str]:
    """The text of a regular file (at most TEXT_LIMIT bytes of it), None when unreadable."""
    try:
        return read_prefix(path, TEXT_LIMIT)[0].decode("utf-8", errors="replace")
    except OSError:
        return None


def load_json(text: str) -> tuple[JSON, Optional[str], Optional[int]]:
    """(data, error, line of the error); never raises, whatever the text."""
    try:
        data: JSON = json.loads(text)
        return data, None, None
    except json.JSONDecodeError as exc:
        what, line, column = json_error_at(exc)
        return None, f"{what} at line {line}, column {column}", line
    except (ValueError, RecursionError) as exc:  # a hostile file nests 100,000 levels deep
        return None, f"{type(exc).__name__}: {exc}", None


# -- content sniffing ----------------------------------------------------------------------


def _lfs_size(head: bytes) -> Optional[int]:
    m = re.search(rb"^size (\d+)\s*$", head, re.MULTILINE)
    return int(m.group(1)) if m else None


def sniff(name: str, head: bytes, size: int) -> Optional[ContentProblem]:
    """Recognise the usual stand-ins for a real file: an LFS pointer, an HTML page, nothing."""
    if size == 0:
        return ContentProblem(name, "empty", "is empty (0 bytes)")
    if head.startswith(_LFS_MAGIC):
        real = _lfs_size(head)
        what = f"the real file has {real:,} bytes" if real is not None else "not the real file"
        return ContentProblem(
            name, "lfs-pointer", f"is a Git LFS pointer of {size} bytes ({what})"
        )
    lead = head.lstrip(b"\xef\xbb\xbf \t\r\n").lower()
    if lead.startswith((b"<!doctype html", b"<html")):
        return ContentProblem(
            name, "html",
            f"is an HTML page of {size:,} bytes (a login or error page saved in its place)",
        )
    return None


def _content_expected(name: str) -> bool:
    # An empty __init__.py is legitimate; every other file of these kinds must have content.
    return name.endswith(_CONTENT_SUFFIXES) and PurePosixPath(name).name != "__init__.py"


# -- safetensors headers -------------------------------------------------------------------


def _shard_error(
    name: str,
    size: Optional[int],
    msg: str,
    header_len: Optional[int] = None,
    truncated: bool = False,
) -> ShardFacts:
    return ShardFacts(name, size=size, header_len=header_len, error=msg, truncated=truncated)


def probe_shard(path: Path, name: str) -> ShardFacts:
    """Validate one safetensors file from its header only (never reads tensor data)."""
    try:
        with os.fdopen(open_regular(path), "rb") as fh:  # a FIFO is refused, never waited on
            size = os.fstat(fh.fileno()).st_size
            prefix = fh.read(8)
            if len(prefix) < 8:
                return _shard_error(
                    name, size,
                    f"is only {size} bytes, too short to hold a safetensors header (loading fails "
                    f"with {ST_TOO_SMALL})",
                    truncated=True,
                )
            (n,) = struct.unpack("<Q", prefix)
            if n > MAX_HEADER:
                return _shard_error(
                    name, size,
                    f"starts with a header length of {n:,} bytes, so it is not a safetensors file "
                    f"(loading fails with {ST_TOO_LARGE})",
                )
            if n < 2:  # not even "{}"
                return _shard_error(
                    name, size, f"starts with a header length of {n}, so it is not a safetensors "
                    "file",
                )
            if 8 + n > size:
                return _shard_error(
                    name, size,
                    f"is {size:,} bytes but its header alone needs {8 + n:,}: the download was cut "
                    "short",
                    header_len=n, truncated=True,
                )
            raw = fh.read(n)
    except OSError as exc:
        return _shard_error(name, None, f"cannot be read: {exc.strerror or exc}")
    header, error, _ = load_json(raw.decode("utf-8", errors="replace"))
    if error is not None:
        return _shard_error(
            name, size,
            f"has a header that is not valid JSON ({error}), so loading fails with "
            + safetensors_symptom("InvalidHeaderDeserialization", "invalid JSON in header"),
            header_len=n,
        )
    if not isinstance(header, dict):
        return _shard_error(name, size, "has a header that is not a JSON object", header_len=n)
    spans: list[tuple[int, int, str]] = []
    packed: dict[str, tuple[int, ...]] = {}
    total = 0
    numel_by_dtype: dict[str, int] = {}
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        tensor = _tensor(key, meta)
        if isinstance(tensor, str):
            return _shard_error(name, size, tensor, header_len=n)
        begin, end = tensor.begin, tensor.end
        spans.append((begin, end, key))
        total += end - begin
        if key.rsplit(".", 1)[-1] in PACKED:
            packed[key] = tensor.shape
        dtype = tensor.dtype
        numel_by_dtype[dtype] = numel_by_dtype.get(dtype, 0) + (end - begin) // DTYPE_SIZES[dtype]
    # safetensors requires the tensors to tile the data area exactly: no gap, no overlap.
    pos = 0
    for begin, end, key in sorted(spans):
        if begin != pos:
            return _shard_error(
                name, size,
                f"has overlapping or non-contiguous data_offsets at tensor {key!r} (starts at "
                f"{begin:,}, expected {pos:,})",
                header_len=n,
            )
        pos = end
    expected = 8 + n + pos
    if size < expected:
        return _shard_error(
            name, size,
            f"is {size:,} bytes but its header describes {expected:,}: the download was cut short "
            f"(loading fails with {ST_INCOMPLETE})",
            header_len=n, truncated=True,
        )
    if size > expected:
        return _shard_error(
            name, size,
            f"is {size:,} bytes but its header describes {expected:,}: it has {size - expected:,} "
            f"extra bytes (loading fails with {ST_INCOMPLETE})",
            header_len=n,
        )
    return ShardFacts(
        name, size=size, header_len=n, tensor_names=frozenset(k for _, _, k in spans),
        tensor_bytes=total, dtype_numel=numel_by_dtype, gptq_shapes=packed,
    )


class _Tensor(NamedTuple):
    """A tensor as a safetensors header describes it: its dtype and its data's span."""

    dtype: str
    begin: int
    end: int
    shape: tuple[int, ...]


def _integer(value: JSON) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _shape(value: JSON) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(_integer(d) and d >= 0 for d in value)


def _span(value: JSON) -> TypeGuard[list[int]]:
    if not isinstance(value, list) or len(value) != 2:
        return False
    begin, end = value
    return _integer(begin) and _integer(end) and 0 <= begin <= end


def _tensor(key: str, meta: JSON) -> Union[_Tensor, str]:
    """The tensor a header entry describes, or why it is not a valid description."""
    if not isinstance(meta, dict):
        return f"describes tensor {key!r} with something that is not an object"
    dtype, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        return f"gives tensor {key!r} an unknown dtype {dtype!r}"
    if not _shape(shape):
        return f"gives tensor {key!r} an invalid shape {shape!r}"
    if not _span(offsets):
        return f"gives tensor {key!r} invalid data_offsets {offsets!r}"
    numel = 1
    for d in shape:
        numel *= d
    need = numel * DTYPE_SIZES[dtype]
    if offsets[1] - offsets[0] != need:
        return (
            f"gives tensor {key!r} ({dtype} {shape}) {offsets[1] - offsets[0]:,} bytes of data "
            f"where it needs {need:,}"
        )
    return _Tensor(dtype, offsets[0], offsets[1], tuple(shape))


# -- the weight index ----------------------------------------------------------------------


def unsafe_member(name: object) -> Optional[str]:
    """Why `name` may not be opened as a file inside the checkpoint (None when it may).

    Judged on the text alone, without touching the file system: resolving symlinks would
    wrongly refuse a huggingface_hub snapshot, whose files all link out to ../../blobs.
    """
    if not isinstance(name, str) or not name:
        return "is not a file name"
    if "\x00" in name:
        return "contains a NUL byte"
    if (
        PurePosixPath(name).is_absolute()
        or PureWindowsPath(name).is_absolute()
        or PureWindowsPath(name).drive
        or name.startswith(("/", "\\"))
    ):
        return "is an absolute path"
    if ".." in re.split(r"[/\\]", name):
        return "climbs out of the checkpoint with `..`"
    return None


def probe_index(root: Path, name: str) -> IndexFacts:
    text = _read_text(root / name)
    if text is None:
        return IndexFacts(name, error="cannot be read")
    data, error, _ = load_json(text)
    if error is not None:
        return IndexFacts(name, error=f"is not valid JSON ({error})")
    if not isinstance(data, dict):
        return IndexFacts(name, error="has no weight_map")
    wm = data.get("weight_map")
    if not isinstance(wm, dict) or not wm:
        return IndexFacts(name, error="has no weight_map")
    safe: dict[str, str] = {}
    files: dict[str, None] = {}
    refused: dict[str, str] = {}
    for tensor, fname in wm.items():
        why = unsafe_member(fname)
        if why is not None:
            refused.setdefault(str(fname), why)
            continue
        member = str(fname)  # unsafe_member passes only non-empty strings
        safe[tensor] = member
        files.setdefault(member, None)
    missing = tuple(f for f in files if not os.path.isfile(root / f))
    meta = data.get("metadata")
    total = meta.get("total_size") if isinstance(meta, dict) else None
    if not isinstance(total, int) or isinstance(total, bool):
        total = None
    return IndexFacts(
        name, weight_map=safe, files=tuple(sorted(files)), refused=tuple(refused.items()),
        missing=missing, total_size=total,
    )


# -- tokenizer ------------------------------------------------------------------------------


def probe_tiktoken(
    path: Path, limit: int = TIKTOKEN_PREFIX
) -> tuple[Optional[int], Optional[str], Optional[int]]:
    """(ranks, error, first bad line number) for a `base64-token rank` per line file.

    Only the first `limit` bytes are read (whole lines of them): Qwen's file is 2.5 MB, and
    a file hundreds of times that size must not cost seconds and gigabytes to judge."""
    try:
        data, size = read_prefix(path, limit)
    except OSError as exc:
        return None, f"cannot be read: {exc.strerror or exc}", None
    if size > len(data):
        data = data[: data.rfind(b"\n") + 1]  # a line cut at the limit is not judged
    ranks = 0
    for lineno, line in enumerate(data.splitlines(), 1):
        if not line:  # the tokenizer skips empty lines, so they are harmless
            continue
        parts = line.split()
        if len(parts) != 2:
            return None, f"has {len(parts)} fields where `base64-token rank` has 2", lineno
        try:
            base64.b64decode(parts[0], validate=True)
        except (binascii.Error, ValueError):
            return None, f"has a token that is not base64 ({parts[0][:40]!r})", lineno
        try:
            int(parts[1])
        except ValueError:
            return None, f"has a rank that is not an integer ({parts[1][:40]!r})", lineno
        ranks += 1
    if ranks == 0:
        return 0, "holds no ranks", None
    return ranks, None, None


# -- remote-code requirements ----------------------------------------------------------------

# The same text rules as transformers' check_imports (4.3x, the versions Qwen pins): drop
# `try: ... except ...:` spans, then collect `import x` / `from x import` anywhere, indented
# or not (imports inside functions count). Relative imports are followed, not required.
_TRY_SPAN = re.compile(r"\s*try\s*:\s*.*?\s*except\s*.*?:", re.MULTILINE | re.DOTALL)
_IMPORT = re.compile(r"^\s*import\s+(\S+)\s*$", re.MULTILINE)
_FROM = re.compile(r"^\s*from\s+(\S+)\s+import", re.MULTILINE)
_REL_IMPORT = re.compile(r"^\s*import\s+\.(\S+)\s*$", re.MULTILINE)
_REL_FROM = re.compile(r"^\s*from\s+\.(\S+)\s+import", re.MULTILINE)


def imports_of(text: str) -> tuple[set[str], set[str]]:
    """(top-level absolute imports, relative module names) as transformers sees them."""
    rel = set(_REL_IMPORT.findall(text)) | set(_REL_FROM.findall(text))
    body = _TRY_SPAN.sub("", text)
    names = _IMPORT.findall(body) + _FROM.findall(body)
    return {n.split(".")[0] for n in names if not n.startswith(".")}, rel


def _auto_map_modules(data: Optional[Mapping[str, JSON]]) -> set[str]:
    out: set[str] = set()
    auto_map = data.get("auto_map") if isinstance(data, Mapping) else None
    if not isinstance(auto_map, Mapping):
        return out
    for ref in auto_map.values():
        for item in ref if isinstance(ref, list) else [ref]:
            # "repo--module.Class" names a module in another repo: not ours to check.
            if isinstance(item, str) and "." in item and "--" not in item:
                out.add(item.rsplit(".", 1)[0])
    return out


def _importable(module: str) -> bool:
    try:
        found = importlib.util.find_spec(module) is not None
    except ValueError:  # in sys.modules without a spec (__main__): it is there
        return True
    except ImportError:
        return False
    # transformers' own check imports each module: installed is not enough for these
    return found and (module not in IMPORT_TO_KNOW or import_error(module) is None)


def scan_requirements(
    root: Path, entry_modules: Iterable[str], skip: Iterable[str] = (), as_fixed: bool = False
) -> tuple[str, ...]:
    """Top-level modules imported by the remote code reachable from `entry_modules`
    (as_fixed: with modeling_qwen.py's imports as they will be once fix has run)."""
    skipped = set(skip)
    seen: set[str] = set()
    todo = [m for m in entry_modules if unsafe_member(f"{m}.py") is None]
    required: set[str] = set()
    while todo:
        module = todo.pop()
        fname = f"{module}.py"
        if module in seen or fname in skipped:
            continue
        seen.add(module)
        text = _read_text(root / fname) if os.path.isfile(root / fname) else None
        if text is None:
            continue
        if as_fixed and fname == MODELING:
            text = compat.as_fixed(text)
        absolute, relative = imports_of(text)
        required |= absolute
        todo.extend(r for r in relative if unsafe_member(f"{r}.py") is None)
    return tuple(sorted(required))


# -- where the checkpoint came from -----------------------------------------------------------


def hub_snapshot(path: Path) -> tuple[Optional[str], Optional[str], Optional[Path]]:
    """(repo_id, revision, cache root) when `path` is `.../models--ORG--NAME/snapshots/REV`."""
    for candidate in (path.absolute(), _resolved(path)):
        if candidate is None:
            continue
        parts = candidate.parts
        if len(parts) >= 4 and parts[-2] == "snapshots":
            m = _HUB_DIR.match(parts[-3])
            if m:
                return "/".join(m.group(1).split("--")), parts[-1], Path(*parts[:-3])
    return None, None, None


def _resolved(path: Path) -> Optional[Path]:
    try:
        return path.resolve()
    except (OSError, RuntimeError):
        return None


# -- the probe ------------------------------------------------------------------------------


def _mentions(text: Optional[str], word: str) -> Optional[bool]:
    return None if text is None else word in text


def _list_dir(
    path: Path,
) -> tuple[list[str], list[str], list[tuple[str, str]], Optional[str]]:
    """(regular files, dangling links, (name, what) of other non-folder entries, error)."""
    files: list[str] = []
    dangling: list[str] = []
    special: list[tuple[str, str]] = []
    try:
        with os.scandir(path) as it:
            for entry in it:
                if entry.name.startswith("."):
                    continue
                try:
                    if entry.is_file(follow_symlinks=True):
                        files.append(entry.name)
                    elif entry.is_symlink() and not os.path.exists(entry.path):
                        dangling.append(entry.name)
                    elif not entry.is_dir(follow_symlinks=True):
                        # a FIFO, socket or device: never opened (a FIFO would block)
                        special.append((entry.name, kind_of(os.stat(entry.path).st_mode)))
                except OSError:
                    dangling.append(entry.name)
    except OSError as exc:
        return [], [], [], exc.strerror or str(exc)
    return sorted(files), sorted(dangling), sorted(special), None


def _sniff_file(root: Path, name: str) -> Optional[ContentProblem]:
    try:
        head, size = read_prefix(root / name, _SNIFF_BYTES)
    except PermissionError as exc:
        return ContentProblem(
            name, "unreadable",
            f"cannot be read by user {current_user()} ({exc.strerror or exc})",
        )
    except OSError as exc:
        return ContentProblem(name, "unreadable", f"cannot be read ({exc.strerror or exc})")
    return sniff(name, head, size)


def _json_problem(root: Path, name: str) -> Optional[ContentProblem]:
    try:
        raw, size = read_prefix(root / name, TEXT_LIMIT)
    except OSError:
        return ContentProblem(name, "unreadable", "cannot be read")
    if size > len(raw):  # judged whole or not at all: a cut-off text is never valid JSON
        return ContentProblem(
            name, "too-large",
            f"is too large to be a configuration file ({size:,} bytes, limit {TEXT_LIMIT:,})",
        )
    _, error, _ = load_json(raw.decode("utf-8", errors="replace"))
    if error is not None:
        return ContentProblem(name, "invalid-json", f"is not valid JSON ({error})")
    return None


def _weights(
    root: Path, files: set[str]
) -> tuple[str, tuple[str, ...], Optional[IndexFacts], list[str]]:
    """(layout, weight files, index, safetensors files to validate), in transformers' order
    of preference: model.safetensors, its index, pytorch_model.bin, its index."""
    if ST_SINGLE in files:
        return "safetensors-single", (ST_SINGLE,), None, [ST_SINGLE]
    loose = sorted(f for f in files if f.endswith(".safetensors"))
    if ST_INDEX in files:
        index = probe_index(root, ST_INDEX)
        if index.error is None:
            present = [f for f in index.files if f not in index.missing]
            return "safetensors-sharded", index.files, index, present
        return "safetensors-sharded", tuple(loose), index, loose
    if BIN_SINGLE in files:
        return "pytorch-bin", (BIN_SINGLE,), None, []
    if BIN_INDEX in files:
        index = probe_index(root, BIN_INDEX)
        bins = index.files if index.error is None else tuple(
            sorted(f for f in files if f.endswith(".bin"))
        )
        return "pytorch-bin", bins, index, []
    if loose:  # shards without their index: transformers will not find them
        return "safetensors-sharded", tuple(loose), None, loose
    return "none", (), None, []


class _Where(TypedDict):
    """The CheckpointFacts known before the folder is read: where it is, where it came
    from, and what it holds that is neither a file nor a folder."""

    path: Path
    name: str
    spelt: Optional[str]
    repo_id: Optional[str]
    revision: Optional[str]
    hub_cache_dir: Optional[Path]
    is_git_checkout: bool
    git_root: Optional[Path]
    special: tuple[tuple[str, str], ...]
    read_only: Optional[str]


def _compat_module_hash() -> Optional[str]:
    """sha256 of qwen_kvprep_compat.py as this qwen-kvprep writes it."""
    try:
        return sha256_bytes((templates_dir() / COMPAT_FILE).read_bytes())
    except OSError:
        return None


def _fast_module_hashes() -> set[str]:
    """sha256 of qwen_kvprep_kv.py as this qwen-kvprep plants it, either way it can."""
    try:
        template = (templates_dir() / FAST_FILE).read_bytes()
    except OSError:
        return set()
    return {sha256_bytes(render_module(template, flag)) for flag in (False, True)}


def _git_root(path: Path) -> Optional[Path]:
    """The git work tree `path` is in (a model folder may be a clone, or a folder inside
    one): the nearest folder from `path` up with a `.git` (a folder, or a worktree's
    file). None outside any."""
    here = path.absolute()
    for folder in (here, *here.parents):
        if os.path.lexists(folder / ".git"):
            return folder
    return None


# a ref file holds a 40-hex commit; a few more bytes tell a longer file from it
_REF_BYTES = 128
_MAX_CACHE_ENTRIES = 1000


def _cache_repo_contents(repo: Path) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """(snapshot folder names, (ref, commit) pairs) of a Hub cache repo folder, bounded."""
    try:
        with os.scandir(repo / "snapshots") as it:
            snapshots = sorted(e.name for e in it if e.is_dir())[:_MAX_CACHE_ENTRIES]
    except OSError:
        snapshots = []
    refs: list[tuple[str, str]] = []
    try:
        with os.scandir(repo / "refs") as it:
            names = sorted(e.name for e in it if e.is_file())[:_MAX_CACHE_ENTRIES]
    except OSError:
        names = []
    for name in names:
        try:
            commit = read_prefix(repo / "refs" / name, _REF_BYTES)[0].decode("ascii").strip()
        except (OSError, UnicodeDecodeError):
            continue
        if re.fullmatch(r"[0-9a-f]{40}", commit):
            refs.append((name, commit))
    return tuple(snapshots), tuple(refs)


def _config_error_kind(cause: Optional[BaseException]) -> Optional[str]:
    """CheckpointFacts.config_error_kind for the exception behind a refused config.json."""
    if isinstance(cause, (json.JSONDecodeError, UnicodeDecodeError)):
        return "json"
    if isinstance(cause, OSError) and cause.errno == errno.EFBIG:
        return "size"
    if isinstance(cause, ValueError) and "digits" in str(cause):
        return "digits"
    return None


def _read_only(path: Path) -> Optional[str]:
    """Why fix could not write in the folder, judged without writing (None: it could, or
    the folder is not there: other findings say so)."""
    if not path.is_dir():
        return None
    access = folder_access(path, "DIR")
    return None if access.writable else access.reason


def probe_checkpoint(path: Path, spelt: Optional[str] = None) -> CheckpointFacts:
    """Everything the checkpoint and config checks need; never raises for a broken checkpoint.
    `spelt` is the path as the user wrote it, kept for checkpoint.dirname."""
    path = Path(path)
    # normpath: "ckpt/" or "a/ckpt/." give the folder's own name "ckpt" (transformers'
    # basename of those spellings is "" or ".": see modcache.spelling_folders).
    name = Path(os.path.normpath(path.absolute())).name
    repo_id, revision, hub_root = hub_snapshot(path)
    git_root = _git_root(path)
    is_git_checkout = git_root is not None
    listing, dangling, special, listing_error = _list_dir(path)
    base: _Where = {
        "path": path, "name": name, "spelt": spelt, "repo_id": repo_id, "revision": revision,
        "hub_cache_dir": hub_root, "is_git_checkout": is_git_checkout, "git_root": git_root,
        "special": tuple(special), "read_only": _read_only(path),
    }
    if listing_error is not None:
        return CheckpointFacts(listing_error=listing_error, **base)
    cache_repo = repo_folder(path)
    if cache_repo is not None:  # not a checkpoint: its snapshots are (checkpoint.identity)
        snapshots, refs = _cache_repo_contents(path)
        return CheckpointFacts(
            files=tuple(listing), cache_repo=cache_repo, cache_snapshots=snapshots,
            cache_refs=refs, **base,
        )
    files = set(listing)

    problems: dict[str, ContentProblem] = {}
    for fname in listing:
        if _content_expected(fname):
            p = _sniff_file(path, fname)
            if p is not None:
                problems[fname] = p
    # JSON files without a check of their own: a parse error is a content problem.
    for fname in (TOKENIZER_CONFIG, GENERATION_CONFIG):
        if fname in files and fname not in problems:
            p = _json_problem(path, fname)
            if p is not None:
                problems[fname] = p
    # quantize_config.json: read by the GPTQ grammar (checkpoint.gptq judges its fields)
    quantize_config: Optional[QuantizeFile] = None
    if QUANTIZE_CONFIG in files and QUANTIZE_CONFIG not in problems:
        quantize_config = read_quantize_config(path / QUANTIZE_CONFIG)
        if quantize_config.error is not None and quantize_config.kind is not None:
            problems[QUANTIZE_CONFIG] = ContentProblem(
                QUANTIZE_CONFIG, quantize_config.kind, quantize_config.error
            )

    config: Optional[dict[str, JSON]] = None
    config_error: Optional[str] = None
    config_error_line: Optional[int] = None
    config_error_kind: Optional[str] = None
    config_path = path / CONFIG
    if CONFIG in files:
        # the same reader and rules as fix: strict UTF-8, unique keys, a size limit
        try:
            config = dict(parse_config_bytes(read_config_bytes(config_path), config_path))
        except ConfigError as exc:
            config_error = exc.message
            cause = exc.__cause__
            if isinstance(cause, json.JSONDecodeError):
                config_error_line = json_error_at(cause)[1]
            config_error_kind = _config_error_kind(cause)
    is_link = config_path.is_symlink()
    link_target: Optional[str] = None
    if is_link:
        try:
            link_target = os.readlink(config_path)
        except OSError:
            link_target = None

    layout, weight_files, index, to_validate = _weights(path, files)
    shards = []
    for fname in to_validate:
        if fname not in files and fname not in problems:  # in a sub-folder: not sniffed yet
            p = _sniff_file(path, fname)
            if p is not None:
                problems[fname] = p
        # An LFS pointer or HTML page is reported as such; its "header" would only add noise.
        if fname not in problems:
            shards.append(probe_shard(path / fname, fname))

    modeling = _read_text(path / MODELING) if MODELING in files else None
    if MODELING in problems:
        modeling = None

    gptq_source: Optional[str] = None
    if QUANTIZE_CONFIG in files:
        gptq_source = QUANTIZE_CONFIG
    elif config is not None:
        qc = config.get("quantization_config")
        if isinstance(qc, Mapping) and str(qc.get("quant_method", "")).lower() == "gptq":
            gptq_source = "config.json quantization_config"

    tiktoken_ranks: Optional[int] = None
    tiktoken_error: Optional[str] = None
    tiktoken_bad: Optional[int] = None
    if TIKTOKEN in files and TIKTOKEN not in problems:
        tiktoken_ranks, tiktoken_error, tiktoken_bad = probe_tiktoken(path / TIKTOKEN)

    tokenizer_config: Optional[Mapping[str, JSON]] = None
    if TOKENIZER_CONFIG in files and TOKENIZER_CONFIG not in problems:
        loaded, _, _ = load_json(_read_text(path / TOKENIZER_CONFIG) or "null")
        tokenizer_config = loaded if isinstance(loaded, dict) else None
    entries = {f[:-3] for f in REMOTE_CODE_FILES if f in files}
    entries |= _auto_map_modules(config) | _auto_map_modules(tokenizer_config)
    requirements = scan_requirements(
        path, sorted(entries), skip=[f for f in problems if f.endswith(".py")]
    )
    missing_requirements = tuple(m for m in requirements if not _importable(m))
    fixed_requirements = scan_requirements(
        path, sorted(entries), skip=[f for f in problems if f.endswith(".py")], as_fixed=True
    )
    fixed_missing = tuple(
        m for m in fixed_requirements if m in missing_requirements or not _importable(m)
    )

    # the record convert writes, when its content says convert wrote it (not another
    # tool's file of that common name)
    record_ours = provenance.PROVENANCE in files and provenance.foreign(path) is None
    loader_text = _read_text(path / LOADER) if LOADER in files else None
    fast_sha = _sha256(path / FAST_FILE) if FAST_FILE in files else None
    compat_sha = _sha256(path / COMPAT_FILE) if COMPAT_FILE in files else None
    compat_imported = modeling is not None and compat.is_patched(modeling)
    compat_current = compat_sha is not None and compat_sha == _compat_module_hash()
    fast_imported = modeling is not None and is_patched(modeling)
    loader_ours = loader_text is not None and LOADER_MARKER in "\n".join(
        loader_text.splitlines()[:10]
    )
    return CheckpointFacts(
        **base,
        files=tuple(listing),
        dangling=tuple(dangling),
        provenance_ours=record_ours,
        config=config,
        config_error=config_error,
        config_error_line=config_error_line,
        config_error_kind=config_error_kind,
        config_is_symlink=is_link,
        config_link_target=link_target,
        modeling_text_supports_kv=_mentions(modeling, "use_cache_quantization"),
        modeling_not_utf8=_not_utf8(path / MODELING) if modeling is not None else None,
        modeling_mentions_kernel=_mentions(modeling, "cache_autogptq_cuda_256"),
        fast_path_problem=recognise(modeling) if modeling is not None else "it is missing",
        fast_path_imported=fast_imported,
        fast_module_sha256=fast_sha,
        fast_module_current=fast_sha is not None and fast_sha in _fast_module_hashes(),
        compat_imported=compat_imported,
        compat_module_sha256=compat_sha,
        compat_module_current=compat_current,
        serves_any_modules_cache=serves_any_modules_cache(
            loader_text if loader_ours else None,
            compat_imported,
            compat_current,
            fast_imported,
            fast_sha,
        ),
        remote_code={f: _sha256(path / f) if f in files else None for f in REMOTE_CODE_FILES},
        gptq=gptq_source is not None,
        gptq_source=gptq_source,
        quantize_config=quantize_config,
        weights_layout=layout,
        weight_files=weight_files,
        index=index,
        shards=tuple(shards),
        content_problems=tuple(problems[k] for k in sorted(problems)),
        tiktoken_ranks=tiktoken_ranks,
        tiktoken_error=tiktoken_error,
        tiktoken_bad_line=tiktoken_bad,
        kernel_sources={k: _sha256(path / k) if k in files else None for k in KERNEL_FILES},
        loader_sha256=_sha256(path / LOADER) if LOADER in files else None,
        loader_is_ours=loader_ours,
        requirements=requirements,
        missing_requirements=missing_requirements,
        fixed_requirements=fixed_requirements,
        fixed_missing=fixed_missing,
    )
