"""provenance.json in OUT: what it was made from, by what, and what is exact.

Written by convert (last but config.json); read back by `doctor OUT` as untrusted input:
a regular file of bounded size, strict JSON, its fields checked by type, every file name a
plain relative name (never a path that climbs out of OUT or DIR).

    {
      "format": 1,
      "tool": "qwen-kvprep", "tool_version": "...",
      "transformers_version": "..." | null, "torch_version": "...",
      "created": "2026-11-27T16:00:00Z",
      "source": {"path": "/abs/DIR", "spelt": "ORG/NAME or the folder as given",
                 "device": N, "inode": N (DIR's own; absent in older records),
                 "files": {"config.json": {"sha256": "...", "size": N, "mtime_ns": N}, ...},
                 "absent": ["generation_config.json", ...] (of INPUTS, those DIR lacked;
                           absent in older records, which hold every one DIR had)},
      "outputs": {"model-00001-of-00002.safetensors": {"sha256": "...", "size": N}, ...},
      "exact_up_to": 8192 | null (yarn: exact at no length),
      "exact": "exact up to 8,192 tokens" (the words convert printed),
      "context": {"factor": null | F, "rope_scaling": null | "yarn" | "dynamic",
                  "max_position_embeddings": N},
      "options": {...},
      "weights": ["model-00001-of-00002.safetensors", ...]
    }
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from qwen_kvprep.errors import StateError
from qwen_kvprep.jsontypes import JSON, JSONObject
from qwen_kvprep.untrusted import describe_json_error, read_record, relpath_problem

PROVENANCE = "provenance.json"
FORMAT = 1
TOOL = "qwen-kvprep"  # a provenance.json is ours only when its "tool" says so
_LIMIT = 4 << 20  # an 82-shard checkpoint's record is about 30 KB
_WORDS_LIMIT = 2000  # "exact" as read back: convert's own sentence is some 200 characters
# DIR's files besides the weights that OUT is made from: each is in the record, among
# `files` when DIR had it, else among `absent` (a file there later makes another OUT)
INPUTS = (
    "config.json", "generation_config.json", "qwen.tiktoken", "tokenizer_config.json",
    "quantize_config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json",
)  # fmt: skip


@dataclass(frozen=True)
class FileRecord:
    sha256: str
    size: int
    mtime_ns: Optional[int] = None

    def to_json(self) -> JSONObject:
        out: JSONObject = {"sha256": self.sha256, "size": self.size}
        if self.mtime_ns is not None:
            out["mtime_ns"] = self.mtime_ns
        return out


@dataclass(frozen=True)
class Provenance:
    source_path: str
    source_files: Mapping[str, FileRecord]
    outputs: Mapping[str, FileRecord]
    exact_up_to: Optional[int]  # None: exact at no length (yarn)
    weights: tuple[str, ...] = ()
    spelt: Optional[str] = None
    tool_version: str = ""
    extra: Mapping[str, JSON] = field(default_factory=dict)  # versions, context, options
    exact: Optional[str] = None  # the words; None: "exact up to N tokens"
    source_identity: Optional[tuple[int, int]] = None  # DIR's (st_dev, st_ino)
    absent: Optional[tuple[str, ...]] = None  # INPUTS that DIR lacked; None: not recorded

    @property
    def absent_inputs(self) -> tuple[str, ...]:
        """The INPUTS DIR lacked: as recorded, else (an older record, which holds every
        one DIR had) those not among its files."""
        if self.absent is not None:
            return self.absent
        return tuple(n for n in INPUTS if n not in self.source_files)

    @property
    def exact_words(self) -> str:
        if self.exact is not None:
            return self.exact
        if self.exact_up_to is None:
            return "exact at no length"
        return f"exact up to {self.exact_up_to:,} tokens"

    def to_json(self) -> JSONObject:
        out: JSONObject = {
            "format": FORMAT,
            "tool": TOOL,
            "tool_version": self.tool_version,
        }
        out.update(self.extra)
        source: JSONObject = {"path": self.source_path, "spelt": self.spelt}
        if self.source_identity is not None:
            source["device"], source["inode"] = self.source_identity
        source["files"] = {k: v.to_json() for k, v in sorted(self.source_files.items())}
        if self.absent is not None:
            absent: list[JSON] = [n for n in sorted(self.absent)]
            source["absent"] = absent
        out["source"] = source
        out["outputs"] = {k: v.to_json() for k, v in sorted(self.outputs.items())}
        out["weights"] = list(self.weights)
        out["exact_up_to"] = self.exact_up_to
        out["exact"] = self.exact_words
        return out

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2) + "\n"


def _bad(path: Path, why: str) -> StateError:
    return StateError(
        f"{path} {why}: it cannot say what this folder was converted from",
        fix="convert DIR again into a new folder to get a sound record",
    )


def _files(path: Path, value: JSON, what: str) -> dict[str, FileRecord]:
    if not isinstance(value, dict):
        raise _bad(path, f"has no {what} object")
    out: dict[str, FileRecord] = {}
    for name, rec in value.items():
        problem = relpath_problem(name)
        if problem is not None or "/" in name:
            raise _bad(path, f"names a {what} file {name!r} that is not a plain file name")
        if not isinstance(rec, dict):
            raise _bad(path, f"has a {what} record for {name} that is not an object")
        sha, size, mtime = rec.get("sha256"), rec.get("size"), rec.get("mtime_ns")
        if (
            not isinstance(sha, str)
            or len(sha) != 64
            or any(c not in "0123456789abcdef" for c in sha)
            or isinstance(size, bool)
            or not isinstance(size, int)
            or size < 0
            or (mtime is not None and (isinstance(mtime, bool) or not isinstance(mtime, int)))
        ):
            raise _bad(path, f"has a malformed {what} record for {name}")
        out[name] = FileRecord(sha, size, mtime)
    return out


def foreign(out: Path) -> Optional[str]:
    """Why OUT's provenance.json is not a record convert wrote (another tool's file of that
    common name), in words; None when there is none, or when its content names qwen-kvprep
    as the tool that wrote it (`read` then judges the rest)."""
    path = out / PROVENANCE
    try:
        data = read_record(path, _LIMIT)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        return f"it cannot be read as a JSON record ({describe_json_error(exc)})"
    if not isinstance(data, dict) or data.get("tool") != TOOL:
        return f'it does not name {TOOL} as the tool that wrote it ("tool": "{TOOL}")'
    return None


def ours(out: Path) -> bool:
    """OUT holds a provenance.json that says convert wrote it."""
    return os.path.lexists(out / PROVENANCE) and foreign(out) is None


def read(out: Path) -> Provenance:
    """OUT's provenance.json; FileNotFoundError when absent, StateError when unsound."""
    path = out / PROVENANCE
    try:
        data = read_record(path, _LIMIT)
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as exc:
        raise _bad(path, describe_json_error(exc)) from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise _bad(path, f"is not a format-{FORMAT} convert record")
    source = data.get("source")
    if not isinstance(source, dict) or not isinstance(source.get("path"), str):
        raise _bad(path, "has no source path")
    exact = data.get("exact_up_to")
    if exact is not None and (isinstance(exact, bool) or not isinstance(exact, int) or exact <= 0):
        raise _bad(path, "has no exact_up_to length")
    words = data.get("exact")
    if exact is None and "exact_up_to" not in data:
        raise _bad(path, "has no exact_up_to length")
    if not isinstance(words, str) or len(words) > _WORDS_LIMIT or not words.isprintable():
        words = None
    weights = data.get("weights", [])
    if not isinstance(weights, list) or not all(isinstance(w, str) for w in weights):
        raise _bad(path, "has a malformed weights list")
    spelt = source.get("spelt")
    device, inode, absent = source.get("device"), source.get("inode"), source.get("absent")
    identity = (device, inode) if isinstance(device, int) and isinstance(inode, int) and (
        _whole(device) and _whole(inode)) else None
    if (device is not None or inode is not None) and identity is None:
        raise _bad(path, "has a malformed source device or inode")
    if absent is not None and (not isinstance(absent, list) or not all(
            isinstance(n, str) and relpath_problem(n) is None and "/" not in n for n in absent)):
        raise _bad(path, "has a malformed list of absent source files")
    version = data.get("tool_version")
    extra = {k: v for k, v in data.items() if k in ("context", "options", "created", "kv_cache")}
    return Provenance(
        source_path=str(source["path"]),
        source_files=_files(path, source.get("files"), "source"),
        outputs=_files(path, data.get("outputs"), "output"),
        exact_up_to=exact,
        weights=tuple(str(w) for w in weights),
        spelt=spelt if isinstance(spelt, str) else None,
        tool_version=version if isinstance(version, str) else "",
        extra=extra,
        exact=words,
        source_identity=identity,
        absent=tuple(str(n) for n in absent) if absent is not None else None,
    )


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
