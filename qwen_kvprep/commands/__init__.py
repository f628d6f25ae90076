"""CLI commands, one module each. Each module has `register(group)` adding its command(s);
`_common` holds what they share (the output options, directory arguments, the exit)."""

from __future__ import annotations

import importlib

import click

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
