from __future__ import annotations

import sys
from typing import NoReturn, Optional

import click

from qwen_kvprep.commands._common import checkpoint_dir, output_options
from qwen_kvprep.commands._dashes import CommandAfterDashes, command_after_dashes
from qwen_kvprep.commands._envflag import EnvFlag
from qwen_kvprep.commands._options import NONEMPTY, arch_option, cache_dir_option
from qwen_kvprep.common import ENV_CACHE
from qwen_kvprep.quickstart import (
    ENV_ALLOW_FALLBACK,
    ENV_ARCH,
    ENV_DIR,
    ENV_OUTPUT,
    ENV_QUIET,
    ENV_SMOKE,
    ENV_SOURCE,
    SOURCES,
    Planting,
    Request,
    hand_over,
    start_ready,
    state_mismatch,
)
from qwen_kvprep.render import prestart_json, report_prestart


@click.command(cls=CommandAfterDashes)
@click.argument("directory", required=False, envvar=ENV_DIR)
@click.option(
    "--output", "-o", metavar="OUT", envvar=ENV_OUTPUT, type=NONEMPTY,
    help="Prepare a view of DIRECTORY in OUT (links + patched copies) and leave "
    f"DIRECTORY untouched; point the server at OUT. [env: {ENV_OUTPUT}]",
)
@click.option(
    "--smoke", is_flag=True, type=EnvFlag(), envvar=ENV_SMOKE,
    help=f"Also require (and run when missing) a passing smoke test. [env: {ENV_SMOKE}=1]",
)
@click.option(
    "--allow-fallback", is_flag=True, type=EnvFlag(), envvar=ENV_ALLOW_FALLBACK,
    help="When preparing fails, print the problem and start CMD anyway (it will run "
    f"without the kernel). [env: {ENV_ALLOW_FALLBACK}=1]",
)
@cache_dir_option(envvar=ENV_CACHE)
@arch_option(
    f'CUDA architectures to build for when a build is needed, e.g. "8.0;9.0". '
    f"[env: {ENV_ARCH}]",
    envvar=ENV_ARCH,
)
@click.option(
    "--source", type=click.Choice(SOURCES), envvar=ENV_SOURCE,
    help="Kernel sources when preparing (as fix --source; default auto). In an image whose "
    f"build was baked from qwen-kvprep's own, use vendored. [env: {ENV_SOURCE}]",
)
@click.option(
    "--revision", metavar="REV",
    help="With a Hub repo id (ORG/NAME) or a Hub cache repo folder as DIRECTORY: the branch, "
    "tag or commit whose snapshot in the local Hub cache to prepare (default main).",
)
@click.option(
    "--quiet", "-q", is_flag=True, type=EnvFlag(), envvar=ENV_QUIET,
    help=f"Print nothing unless something fails. [env: {ENV_QUIET}=1]",
)
@click.pass_context
def prestart(
    ctx: click.Context,
    directory: Optional[str],
    output: Optional[str],
    smoke: bool,
    allow_fallback: bool,
    cache_dir: Optional[str],
    arch: Optional[str],
    source: Optional[str],
    revision: Optional[str],
    quiet: bool,
) -> None:
    """Make sure DIRECTORY is prepared, then exec CMD:  prestart DIR [OPTIONS] -- CMD ARGS...

    When the state `fix` recorded still matches (file hashes, torch/transformers versions,
    the build, the modules-cache copies) this takes milliseconds and imports neither torch
    nor transformers. Otherwise it does the missing part of fix (smoke only with --smoke).
    CMD replaces this process, so its signals and exit code are its own; without `--`,
    prestart exits 0 when the directory is ready (`--` with nothing after it is a usage
    error). Its own messages go to stderr; --json prints one JSON line on stdout before CMD
    starts.
    DIRECTORY may come from $QWEN_KVPREP_DIR.
    """
    given, command = command_after_dashes(ctx, directory)
    path, _ = checkpoint_dir(given, revision, quiet=quiet)
    run(Request(str(path), output=output, smoke=smoke, allow_fallback=allow_fallback,
                cache_dir=cache_dir, arch=arch, quiet=quiet, command=command, source=source,
                as_json=output_options().as_json))


def run(request: Request) -> NoReturn:
    """The quick start once more (click has parsed the options), else the slow path; then
    hand over to CMD."""
    planting = Planting()
    reason = state_mismatch(request, planting)
    if reason is None:
        start_ready(request, planting)
    # here, not at the top: fix's modules cost every start of the CLI ~35 ms
    from qwen_kvprep.steps.prestart import prepare_or_fall_back

    done = prepare_or_fall_back(request, planting, reason)
    report_prestart(request, done)
    if request.as_json:
        sys.stdout.write(prestart_json(request, planting, reason, done) + "\n")
    hand_over(request.command)


def register(group: click.Group) -> None:
    group.add_command(prestart)
