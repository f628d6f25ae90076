"""Reading config.json as doctor, plan and fix all judge it.

A model config is data from a folder anyone with write access may have changed: it is
read as a regular file with a size limit, decoded as strict UTF-8 and parsed with a depth
limit, and a key that appears twice in one object is refused (json.loads would keep the
last one silently, and so would transformers). Every failure is a ConfigError that says
what is wrong and how to get a sound copy back.
"""

from __future__ import annotations

import json
import shlex
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING

from qwen_kvprep import hubcli
from qwen_kvprep.errors import ConfigError, current_user
from qwen_kvprep.untrusted import (
    DuplicateKey,
    NotRegularFile,
    TooLarge,
    json_error_at,
    load_json,
    read_regular,
)

if TYPE_CHECKING:
    from qwen_kvprep.jsontypes import JSON

CONFIG = "config.json"

# A model config is a few KiB; anything near this is not one (and is never read whole).
CONFIG_LIMIT = 16 << 20
CONFIG_DEPTH = 64


def _redownload(path: Path) -> str:
    return (
        f"re-download it: `{hubcli.download()} <repo> {CONFIG} --local-dir "
        f"{shlex.quote(str(path.parent))} --force-download`"
    )


def _ordered_unique(pairs: list[tuple[str, JSON]]) -> OrderedDict[str, JSON]:
    out: OrderedDict[str, JSON] = OrderedDict()
    for key, value in pairs:
        if key in out:
            raise DuplicateKey(f"the key {key!r} appears twice in one object")
        out[key] = value
    return out


def parse_config_bytes(raw: bytes, path: Path) -> OrderedDict[str, JSON]:
    """config.json as doctor and fix both judge it: strict UTF-8, JSON, unique keys (a
    duplicate would be merged silently by json.loads, the last one winning), an object.
    Raises ConfigError (its __cause__ a JSONDecodeError when the parser stopped)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path} is not UTF-8 text (byte {exc.start} is 0x{raw[exc.start]:02x}), so "
            "transformers cannot read it",
            fix=f"convert it to UTF-8, or {_redownload(path)}",
        ) from exc
    return parse_config(text, path)


def parse_config(text: str, path: Path) -> OrderedDict[str, JSON]:
    try:
        data = load_json(text.encode("utf-8"), CONFIG_DEPTH, _ordered_unique)
    except json.JSONDecodeError as exc:
        what, line, column = json_error_at(exc)
        raise ConfigError(
            f"{path} is not valid JSON: {what} at line {line}, column {column}",
            fix=f"repair line {line} of {shlex.quote(str(path))}, or {_redownload(path)}",
        ) from exc
    except DuplicateKey as exc:
        raise ConfigError(
            f"{path} is ambiguous: {exc} (transformers would silently keep the last value)",
            fix=f"remove the duplicate from {shlex.quote(str(path))}, or {_redownload(path)}",
        ) from exc
    except ValueError as exc:  # hostile nesting (or a lone surrogate): refuse, no traceback
        raise ConfigError(
            f"{path} cannot be a model config: {exc}", fix=_redownload(path)
        ) from exc
    if not isinstance(data, OrderedDict):
        raise ConfigError(
            f"{path} does not hold a JSON object", fix=_redownload(path)
        )
    return data


def read_config(path: Path) -> OrderedDict[str, JSON]:
    """Read and parse config.json (a regular file, or a link to one). ConfigError when it
    is missing, not a regular file, unreadable, too large or not a valid config."""
    return parse_config_bytes(read_config_bytes(path), path)


def read_config_bytes(path: Path) -> bytes:
    try:
        return read_regular(path, CONFIG_LIMIT)
    except FileNotFoundError as exc:
        raise ConfigError(f"{path} does not exist", fix=_redownload(path)) from exc
    except NotRegularFile as exc:
        raise ConfigError(
            f"{path} {exc.strerror}", fix=f"replace it with the real file: {_redownload(path)}"
        ) from exc
    except TooLarge as exc:
        raise ConfigError(
            f"{path} is too large to be a model config ({exc.size:,} bytes, limit "
            f"{exc.limit:,})",
            fix=_redownload(path),
        ) from exc
    except PermissionError as exc:
        raise ConfigError(
            f"{path} cannot be read by user {current_user()}: {exc.strerror}",
            fix=f"make it readable (`chmod a+r {shlex.quote(str(path))}`) or run as its owner",
        ) from exc
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from exc
