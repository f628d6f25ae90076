"""Advice that works when pasted: the `qwen-kvprep ...` commands in a finding's or an error's
fix text name a real command with options it has, and write nowhere they must not.

`commands_in(text)` finds the commands (each `...` quoted part that starts with qwen-kvprep,
else the text from qwen-kvprep to where the prose goes on); `check_advice(text, ...)`
parses each with the click command it names (its own parser: unknown options, missing
option values, missing and extra arguments fail) and checks the folders it would write: never inside
one of `models` (the user's model folders), and `fix`/`prestart` on a `read_only` folder
only with -o/--output.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Iterable
from pathlib import Path
from typing import Union

import click

from qwen_kvprep.cli import cli

PathLike = Union[str, "os.PathLike[str]"]

# options whose value is a folder or file the command writes
_WRITES = frozenset({"export_dir", "output", "lock_file", "cache_dir", "plot"})
# commands that write into their DIRECTORY argument unless -o/--output names a view
_WRITES_DIRECTORY = frozenset({"fix", "prestart", "revert"})
# where the prose goes on after a command written without backticks
_PROSE = re.compile(r"\s\(|;|, then\b|, or\b|\.\s|\.$|\s+again\b")


def commands_in(text: str) -> list[str]:
    quoted = [part.strip() for part in text.split("`")[1::2]]
    found = [part for part in quoted if part.split(" ", 1)[0] == "qwen-kvprep"]
    if found or "`" in text:
        return found
    start = text.find("qwen-kvprep ")
    if start < 0:
        return []
    rest = text[start:]
    m = _PROSE.search(rest)
    return [rest[: m.start()].strip() if m else rest.strip()]


def _inside(path: str, folder: PathLike) -> bool:
    p = os.path.realpath(os.path.expanduser(path))
    f = os.path.realpath(os.fspath(folder))
    return p == f or p.startswith(f.rstrip(os.sep) + os.sep)


def check_command(
    line: str, models: Iterable[PathLike] = (), read_only: Iterable[PathLike] = ()
) -> None:
    words = shlex.split(line)
    assert words[0] == "qwen-kvprep" and len(words) > 1, f"{line!r}: no command"
    name = words[1]
    command = cli.commands.get(name)
    assert command is not None, f"{line!r}: no command {name!r}"
    own = words[2 : words.index("--")] if "--" in words else words[2:]
    parser = command.make_parser(click.Context(command, info_name=name))
    try:
        values, extra, _ = parser.parse_args(own)
    except click.UsageError as exc:
        raise AssertionError(f"{line!r}: {exc.format_message()}") from None
    assert not extra, f"{line!r}: arguments {name} does not take: {extra}"
    # click's parser gives an argument that is not there a sentinel, not a string
    missing = [p.name for p in command.params if isinstance(p, click.Argument)
               and p.required and not isinstance(values.get(p.name or ""), (str, tuple))]
    assert not missing, f"{line!r}: {name} needs {missing}"
    models, read_only = list(models), list(read_only)
    for key in _WRITES & set(values):
        value = str(values[key])
        bad = [m for m in [*models, *read_only] if _inside(value, m)]
        assert not bad, f"{line!r}: writes {value} inside the model folder {bad[0]}"
    directory = values.get("directory")
    if name in _WRITES_DIRECTORY and directory is not None and "output" not in values:
        bad = [m for m in read_only if _inside(str(directory), m)]
        assert not bad, f"{line!r}: writes into the read-only folder {bad[0]}"


def check_advice(
    text: str,
    models: Iterable[PathLike] = (),
    read_only: Iterable[PathLike] = (),
    expect: bool = True,
) -> list[str]:
    """Check every qwen-kvprep command in `text`; with `expect`, there must be one."""
    models, read_only = [Path(m) for m in models], [Path(r) for r in read_only]
    found = commands_in(text)
    assert found or not expect, f"no qwen-kvprep command in {text!r}"
    for line in found:
        check_command(line, models, read_only)
    return found
