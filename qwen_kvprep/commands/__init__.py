"""CLI commands, one module each. Each module has `register(group)` adding its command(s);
`_common` holds what they share (the output options, directory arguments, the exit).
`register` also gives every command the global options (--debug, --json), so they work
after the command as well as before it."""

from __future__ import annotations

import importlib

import click

from qwen_kvprep.commands._common import debug_option, json_option

# A command module is added here when it is written.
_MODULES = [
    "doctor",
    "fix",
    "revert",
    "prestart",
    "template",
    "smoke",
    "build",
    "demo",
    "plan",
    "profile",
]


def register(group: click.Group) -> None:
    for name in _MODULES:
        importlib.import_module(f"qwen_kvprep.commands.{name}").register(group)
    for command in group.commands.values():
        spelt = {opt for param in command.params for opt in param.opts}
        if "--debug" not in spelt:
            debug_option(command)
        if "--json" not in spelt:
            json_option(command)
