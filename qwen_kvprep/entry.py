"""The `qwen-kvprep` console entry point.

`prestart` runs on every container start, and importing click and the command tree costs
several times what the whole quick start does. So `prestart` is answered here, before click
is imported, when its recorded state still matches; every other case (other commands,
--help, a slow path, a usage error) goes to the click CLI in qwen_kvprep.cli.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Optional


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    # the global options may come first (`qwen-kvprep --json prestart ...`); prestart's
    # quick start reads them among its own
    lead = 0
    while lead < len(args) and args[lead] in ("--json", "--debug"):
        lead += 1
    if lead < len(args) and args[lead] == "prestart":
        # only prestart takes the quick start; every other command goes on to click
        from qwen_kvprep.quickstart import fast

        try:
            # execs CMD or exits when the state matches; returns otherwise
            fast([*args[:lead], *args[lead + 1 :]])
        except KeyboardInterrupt:  # as cli.main answers Ctrl-C, without importing it
            sys.stderr.write("qwen-kvprep: interrupted\n")
            raise SystemExit(130) from None
    # here, not at the top: prestart's quick start never imports click and the commands
    from qwen_kvprep.cli import main as cli_main

    try:
        cli_main(args)
    finally:
        # the process ends here, with everything written: spare the interpreter's exit a
        # last garbage collection over every object torch and transformers made (0.6 s of
        # a 3 s doctor on 2 cores). Not in cli.main, which tests also call in-process.
        import gc

        gc.freeze()
