"""Parent side of the smoke test: run the child, bounded in time, and collect what it said.

The process machinery (own session, timeout, log tail, event pipe) is shared with
`profile` in qwen_kvprep.childproc; this module only says which child to run.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, cast

from qwen_kvprep.childproc import (
    ChildOutcome,
    ShownEvent,
    child_env,
    run_events_child,
    tail_lines,
)
from qwen_kvprep.common import spelling_problem
from qwen_kvprep.smoke.protocol import (
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_PROMPT,
    DEFAULT_TIMEOUT_S,
    SmokeResult,
)

__all__ = [
    "ChildOutcome",
    "PhaseCallback",
    "SmokeOptions",
    "SmokeOutcome",
    "child_command",
    "child_env",
    "run_child",
    "tail_lines",
]

PhaseCallback = Callable[[str], None]
SmokeOutcome = ChildOutcome[SmokeResult]


@dataclass(frozen=True)
class SmokeOptions:
    device: str = "auto"
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    prompt: str = DEFAULT_PROMPT
    timeout: float = DEFAULT_TIMEOUT_S
    # the path the child loads by, spelt as the user gave it (absolute, but with its
    # trailing slash or `.` kept: transformers names the modules-cache folder after it);
    # None: the directory itself
    load_path: Optional[str] = None
    # what a smoke that timed out advises running for more time: the command that ran it
    # (quoted for a shell, less its timeout option) and that option; None: `qwen-kvprep
    # smoke DIR` and --timeout (fix's option is --smoke-timeout)
    rerun: Optional[tuple[str, str]] = None


def spelt_as_given(given: str) -> str:
    """`given` made absolute without normalising it (`x/` stays `/cwd/x/`, `.` becomes
    `/cwd/.`), so a child started elsewhere loads the model by the same spelling."""
    import os

    return given if os.path.isabs(given) else os.path.join(os.getcwd(), given)


def load_path_for(given: str) -> tuple[str, Optional[str]]:
    """(the path the smoke loads by, why not `given` itself): DIR as the user spelt it,
    unless the installed transformers cannot load any model by that spelling (then the
    directory's normalised absolute path, and the reason, which the caller reports)."""
    import importlib.metadata
    import os


    try:
        version: Optional[str] = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        version = None
    problem = spelling_problem(given, version)
    if problem is not None:
        return os.path.abspath(given), problem
    return spelt_as_given(given), None


def child_command(directory: Path, options: SmokeOptions, fd: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "qwen_kvprep.smoke.child",
        options.load_path or str(directory),
        "--fd",
        str(fd),
        "--device",
        options.device,
        "--max-new-tokens",
        str(options.max_new_tokens),
        "--prompt",
        options.prompt,
    ]


def run_child(
    directory: Path, options: SmokeOptions, on_phase: Optional[PhaseCallback] = None
) -> SmokeOutcome:
    def on_event(event: ShownEvent) -> None:
        if on_phase is not None and event.get("event") == "phase":
            on_phase(str(event.get("phase")))

    outcome = run_events_child(
        # looked up at call time, so tests can stand in a child of their own
        lambda fd: child_command(directory, options, fd),
        options.timeout,
        on_event,
        prefix="qwen-kvprep-smoke-",
    )
    # the child is qwen_kvprep.smoke.child of this very installation (child_env puts it
    # first on the path): its result is the SmokeResult it builds
    return cast(SmokeOutcome, outcome)
