"""CLI commands, one module each. Each module has `register(group)` adding its command(s);
`_common` holds what they share (the output options, directory arguments, the exit).
`register` also gives every command the global options (--debug, --json), so they work
after the command as well as before it."""

from __future__ import annotations

import click

from qwen_kvprep.commands import (
    build,
    cache,
    convert,
    demo,
    doctor,
    fix,
    plan,
    prestart,
    profile,
    revert,
    smoke,
    template,
)
from qwen_kvprep.commands._common import debug_option, json_option

# In --help's order. Every module is imported at start anyway (click needs each command's
# options to parse), so the table holds the modules themselves, not their names.
_MODULES = [
    doctor, fix, convert, revert, prestart, template, smoke, build, cache, demo, plan, profile
]


def register(group: click.Group) -> None:
    for module in _MODULES:
        module.register(group)
    for command in group.commands.values():
        spelt = {opt for param in command.params for opt in param.opts}
        if "--debug" not in spelt:
            debug_option(command)
        if "--json" not in spelt:
            json_option(command)
