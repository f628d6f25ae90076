from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import click

from qwen_kvprep.commands._common import (
    checkpoint_dir,
    command_line_without,
    exit_code,
    json_option,
    output_options,
)
from qwen_kvprep.commands._numbers import FiniteFloatRange
from qwen_kvprep.commands._options import NONEMPTY, arch_option, cache_dir_option, quiet_option
from qwen_kvprep.errors import UsageError
from qwen_kvprep.render import print_fix
from qwen_kvprep.smoke.progress import step_log


@click.command()
@click.argument("directory")
@click.option("--dry-run", is_flag=True, help="Show what would change (diffs) and write nothing.")
@click.option("--no-build", is_flag=True, help="Skip compiling the extension.")
@click.option("--no-smoke", is_flag=True, help="Skip the smoke generation.")
@click.option("--smoke", "force_smoke", is_flag=True,
              help="Run the smoke even when nothing changed since it last passed (by default "
              "an unchanged checkpoint keeps its recorded verdict and loads nothing).")
@click.option("--no-fast-path", is_flag=True,
              help="Leave modeling_qwen.py as it is (or as it was before fix): the Int8 cache "
              "then runs the model's own, slower code.")
@click.option("--per-token-prefill", is_flag=True,
              help="Fast path: quantize a prompt with one scale per token instead of the "
              "model's one per prompt (much smaller error where token norms vary; not the "
              "model's own numbers).")
@click.option("--smoke-timeout", type=FiniteFloatRange(min=1.0), metavar="S",
              help="Seconds the smoke child process may take before it is killed (default 900).")
@json_option
@quiet_option
@click.option("--source", type=click.Choice(["auto", "vendored", "hub"]), default="auto",
              show_default=True,
              help="Kernel sources: auto keeps a correct pair already in DIRECTORY, else uses "
              "qwen-kvprep's own; vendored always uses qwen-kvprep's; hub downloads Qwen's "
              "official files (sha256-verified) through huggingface_hub.")
@click.option("--repo-id", metavar="ORG/NAME",
              help="Hub repo for --source hub (default: the repo DIRECTORY is a cache "
              "snapshot of).")
@click.option("--revision", metavar="REV",
              help="Branch, tag or commit: of the repo DIRECTORY names when it is a Hub repo "
              "id or a Hub cache repo folder (its snapshot in the local Hub cache; default "
              "main), and for --source hub (default: the snapshot's commit, else main).")
@click.option("--prebuilt", metavar="SOURCE", type=NONEMPTY,
              help="Install a prebuilt extension instead of compiling: SOURCE is a folder "
              "written by `build --export`, a Hub repo ORG/NAME[@REVISION], or a lock file "
              "written by `build --lock`. The variant this machine needs is verified (sha256) "
              "before anything is written; no compiler is used.")
@click.option("--output", "-o", metavar="OUT", type=NONEMPTY,
              help="Read-only DIRECTORY: prepare a view of it in OUT (links to the weights, "
              "patched copies of what fix changes) and fix that; DIRECTORY is not touched. "
              "Serve from OUT.")
@cache_dir_option()
@arch_option('GPU architectures to build for, e.g. "8.0;9.0" (default: '
             "TORCH_CUDA_ARCH_LIST, else the visible GPUs, else every architecture nvcc "
             "supports).")
def fix(
    directory: str,
    dry_run: bool,
    no_build: bool,
    no_smoke: bool,
    force_smoke: bool,
    no_fast_path: bool,
    per_token_prefill: bool,
    smoke_timeout: Optional[float],
    source: str,
    repo_id: Optional[str],
    revision: Optional[str],
    prebuilt: Optional[str],
    output: Optional[str],
    cache_dir: Optional[str],
    arch: Optional[str],
    quiet: bool,
) -> None:
    """Make DIRECTORY's Int8 KV cache work: validate, provide the kernel sources, patch
    config.json, build the extension, install the loader and prove it.

    DIRECTORY is the checkpoint folder, or a Hub repo id (ORG/NAME) found in the local Hub
    cache: fix then prepares its snapshot folder, replacing the links it changes by regular
    files (the shared blobs are never written)."""
    # here, not at the top: fix's steps cost every start of the CLI, --help included, ~55 ms
    from qwen_kvprep.steps.fix import FixOptions, run_fix

    if force_smoke and no_smoke:
        raise UsageError("--smoke and --no-smoke contradict each other: give one")
    as_json = output_options().as_json
    path, spelt = checkpoint_dir(directory, revision, revision_of_folder=True, quiet=quiet)
    options = FixOptions(
        dry_run=dry_run, build=not no_build, smoke=not no_smoke, force_smoke=force_smoke,
        fast_path=not no_fast_path, per_token_prefill=per_token_prefill,
        smoke_timeout=smoke_timeout, source=source, repo_id=repo_id, revision=revision,
        output=Path(output).absolute() if output else None,
        progress=False if as_json or quiet else None,  # download bars: --json/-q want none
        cache_dir=Path(cache_dir).absolute() if cache_dir else None,
        arch=arch, spelling=spelt, prebuilt=prebuilt, quiet=quiet,
        rerun=command_line_without("--smoke-timeout", "--dry-run", "--json"),
    )
    log = None if quiet else step_log()  # a log (CI): a line a step and a heartbeat
    try:
        result = run_fix(path, options, log=log)
    finally:
        if log is not None:
            log.close()
    rerun = command_line_without("--dry-run", "--json")
    print_fix(path, output or spelt, dry_run, result, as_json, rerun=rerun, quiet=quiet)
    sys.exit(exit_code(result.findings))


def register(group: click.Group) -> None:
    group.add_command(fix)
