from __future__ import annotations

import sys
from typing import NoReturn, Optional

import click

from qwen_kvprep.common import ENV_CACHE
from qwen_kvprep.fastpath import (
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
    say,
    start_ready,
    state_mismatch,
)
from qwen_kvprep.steps.prestart import Prepared, prepare_or_fall_back

_COMMAND_KEY = "qwen_kvprep.prestart.command"
_DASHES_KEY = "qwen_kvprep.prestart.dashes"


class _CommandAfterDashes(click.Command):
    """Everything after the first `--` is CMD, taken whole before click parses the rest:
    click would otherwise give CMD's first word to DIR when DIR comes from
    $QWEN_KVPREP_DIR, and read CMD's own options as ours."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        command: list[str] = []
        ctx.meta[_DASHES_KEY] = "--" in args
        if "--" in args:
            cut = args.index("--")
            args, command = args[:cut], args[cut + 1 :]
        ctx.meta[_COMMAND_KEY] = command
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as exc:
            if "extra argument" not in exc.message:
                raise
            hint = "; put the command after `--`: prestart DIR -- CMD ARGS..."
            raise click.UsageError(exc.message + hint, ctx) from None


@click.command(cls=_CommandAfterDashes)
@click.argument("directory", required=False, envvar=ENV_DIR)
@click.option(
    "--output", "-o", metavar="OUT", envvar=ENV_OUTPUT,
    help="Prepare a view of DIRECTORY in OUT (links + patched copies) and leave "
    f"DIRECTORY untouched; point the server at OUT. [env: {ENV_OUTPUT}]",
)
@click.option(
    "--smoke", is_flag=True, envvar=ENV_SMOKE,
    help=f"Also require (and run when missing) a passing smoke test. [env: {ENV_SMOKE}=1]",
)
@click.option(
    "--allow-fallback", is_flag=True, envvar=ENV_ALLOW_FALLBACK,
    help="When preparing fails, print the problem and start CMD anyway (it will run "
    f"without the kernel). [env: {ENV_ALLOW_FALLBACK}=1]",
)
@click.option(
    "--cache-dir", metavar="DIR", envvar=ENV_CACHE,
    help=f"Build cache folder (shared between replicas is fine). [env: {ENV_CACHE}]",
)
@click.option(
    "--arch", metavar="LIST", envvar=ENV_ARCH,
    help=f'CUDA architectures to build for when a build is needed, e.g. "8.0;9.0". '
    f"[env: {ENV_ARCH}]",
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
    "--quiet", "-q", is_flag=True, envvar=ENV_QUIET,
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
    from qwen_kvprep.commands._common import checkpoint_dir, output_options
    from qwen_kvprep.errors import UsageError

    if directory is None:
        raise UsageError(
            "prestart needs the model directory",
            fix=f"qwen-kvprep prestart DIR -- CMD ..., or set {ENV_DIR}",
        )
    command: list[str] = ctx.meta.get(_COMMAND_KEY, [])
    if ctx.meta.get(_DASHES_KEY) and not command:
        # an image whose CMD is empty: starting nothing and exiting 0 would look like a
        # server that stopped cleanly
        raise UsageError(
            "nothing after `--`: prestart starts the command that follows it",
            fix="put the server command after `--`: qwen-kvprep prestart DIR -- python3 -m "
            "your_server (in an image: give it a CMD); to only prepare DIR, leave out `--`",
        )
    path, _ = checkpoint_dir(directory, revision, quiet=quiet)
    run(
        Request(
            str(path),
            output=output,
            smoke=smoke,
            allow_fallback=allow_fallback,
            cache_dir=cache_dir,
            arch=arch,
            quiet=quiet,
            command=command,
            source=source,
            as_json=output_options().as_json,
        )
    )


def run(request: Request) -> NoReturn:
    """The fast path once more (click has parsed the options), else the slow path; then
    hand over to CMD."""
    planting = Planting()
    reason = state_mismatch(request, planting)
    if reason is None:
        start_ready(request, planting)
    say(request, f"preparing: {reason}")
    done = prepare_or_fall_back(request, planting)
    _report(request, done)
    if request.as_json:
        _print_json(request, planting, reason, done)
    hand_over(request.command)


def _print_json(request: Request, planting: Planting, reason: str, done: Prepared) -> None:
    """The --json document of a start that prepared DIR (or fell back), before exec."""
    from qwen_kvprep.errors import KvprepError
    from qwen_kvprep.fastpath import json_document
    from qwen_kvprep.redact import scrub_findings

    error = None
    if done.failure is not None:
        failure = done.failure
        error = {
            "message": failure.message if isinstance(failure, KvprepError) else repr(failure),
            "fix": failure.fix if isinstance(failure, KvprepError) else None,
        }
    findings = [f.to_json() for f in scrub_findings(done.findings)]
    sys.stdout.write(json_document(request, planting, reason, findings, error) + "\n")


def _report(request: Request, done: Prepared) -> None:
    """What the slow path did, on stderr (stdout belongs to CMD)."""
    from qwen_kvprep.errors import KvprepError
    from qwen_kvprep.redact import scrub

    if done.failure is not None:
        if request.as_json:
            pass  # the document on stdout carries the failure
        elif isinstance(done.failure, KvprepError):
            from qwen_kvprep.render import report_error

            report_error(done.failure, as_json=False)
        else:
            sys.stderr.write(
                f"qwen-kvprep prestart: unexpected error: {scrub(repr(done.failure))}\n"
            )
        if done.view_error is not None:
            sys.stderr.write(
                f"qwen-kvprep prestart: cannot make {request.target} a view: "
                f"{scrub(str(done.view_error))}\n"
            )
        # not through say(): --quiet silences success, never this
        sys.stderr.write("qwen-kvprep prestart: WARNING: --allow-fallback: starting the "
                         "command without a working Int8 KV cache kernel\n")
        return
    if done.findings and not request.quiet and not request.as_json:
        from qwen_kvprep.render import emit, render_human

        emit(render_human(done.findings), sys.stderr)
    if done.recheck is not None:
        say(request, f"note: prepared, but the next start will check again ({done.recheck})")


def register(group: click.Group) -> None:
    group.add_command(prestart)
