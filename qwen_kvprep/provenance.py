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
                 "files": {"config.json": {"sha256": "...", "size": N, "mtime_ns": N}, ...}},
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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from qwen_kvprep.common import sha256_file
from qwen_kvprep.errors import StateError
from qwen_kvprep.jsontypes import JSON, JSONObject
from qwen_kvprep.untrusted import describe_json_error, read_record, relpath_problem

PROVENANCE = "provenance.json"
FORMAT = 1
_LIMIT = 4 << 20  # an 82-shard checkpoint's record is about 30 KB
_WORDS_LIMIT = 2000  # "exact" as read back: convert's own sentence is some 200 characters


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
            "tool": "qwen-kvprep",
            "tool_version": self.tool_version,
        }
        out.update(self.extra)
        out["source"] = {
            "path": self.source_path,
            "spelt": self.spelt,
            "files": {k: v.to_json() for k, v in sorted(self.source_files.items())},
        }
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
    )


# -- DIR's files besides the weights, as convert read them ---------------------------------


def snapshot(directory: Path, names: Iterable[str]) -> dict[str, FileRecord]:
    """The files of `names` that `directory` holds, hashed now. Taken before convert reads
    them and again at its end (`changed`): equal records mean the bytes convert read are
    the bytes the record names."""
    out: dict[str, FileRecord] = {}
    for name in names:
        path = directory / name
        try:
            st = os.stat(path)
            if not os.path.isfile(path):
                continue  # a FIFO, a folder: the file's own check says what is wrong
            out[name] = FileRecord(sha256_file(path), st.st_size, st.st_mtime_ns)
        except OSError:
            continue  # absent or unreadable: the file's own check says so
    return out


def changed(
    directory: Path, names: Iterable[str], before: Mapping[str, FileRecord]
) -> list[str]:
    """The names of `names` whose file is not what `before` recorded: changed, removed,
    or there now and not then."""
    now = snapshot(directory, names)
    return sorted(
        n for n in set(before) | set(now)
        if n not in before or n not in now or now[n].sha256 != before[n].sha256
    )
