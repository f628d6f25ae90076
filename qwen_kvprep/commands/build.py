from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Optional

import click

from qwen_kvprep.commands._common import finish, json_option, output_options
from qwen_kvprep.commands._options import (
    NONEMPTY,
    NonEmptyPath,
    arch_option,
    cache_dir_option,
    check_seconds,
    quiet_option,
)
from qwen_kvprep.errors import UsageError
from qwen_kvprep.smoke.progress import step_log


@click.command()
@arch_option(
    'GPU architectures, e.g. "8.0;9.0" or "8.6+PTX" (default: TORCH_CUDA_ARCH_LIST, '
    "else the visible GPUs, else every architecture the installed nvcc supports).",
)
@cache_dir_option()
@click.option("--source-dir", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Build the kernel sources in this folder (default: qwen-kvprep's own).")
@click.option("--force", is_flag=True, help="Rebuild even if the cache has this build.")
@click.option("--lock-timeout", type=str, metavar="SECONDS", callback=check_seconds,
              help="Longest wait for another build of the same key (default: "
              "$QWEN_KVPREP_LOCK_TIMEOUT, else 600).")
@click.option(
    "--export",
    "export_dir",
    type=NonEmptyPath(file_okay=False, path_type=Path),
    metavar="DIR",
    help="Also put the build into DIR/build/<variant>/ as a prebuilt variant (publish DIR "
    "with `hf upload ORG/NAME DIR`; `fix --prebuilt` installs it without a compiler).",
)
@click.option(
    "--lock",
    "lock_source",
    metavar="SOURCE", type=NONEMPTY,
    help="Compile nothing: pin SOURCE's revision and every variant's digests in a lock file "
    "(see --lock-file) that `fix --prebuilt FILE` then requires.",
)
@click.option(
    "--lock-file",
    type=NonEmptyPath(dir_okay=False, path_type=Path),
    default=Path("kvprep.lock.json"),
    show_default=True,
    metavar="FILE",
    help="Where --lock writes the lock.",
)
@click.option(
    "--fetch",
    "fetch_source",
    metavar="SOURCE", type=NONEMPTY,
    help="Compile nothing: download every variant of SOURCE (a Hub repo or a lock file) into "
    "the huggingface_hub cache and verify them, for images that run with HF_HUB_OFFLINE=1.",
)
@json_option
@quiet_option
def build(
    arch: Optional[str],
    cache_dir: Optional[str],
    source_dir: Optional[Path],
    force: bool,
    lock_timeout: Optional[float],
    export_dir: Optional[Path],
    lock_source: Optional[str],
    lock_file: Path,
    fetch_source: Optional[str],
    quiet: bool,
) -> None:
    """Compile the KV-cache extension for this torch into the build cache.

    No GPU is needed. One build per ABI (torch, CUDA, Python, architectures, sources) is
    kept; an existing one is reused in milliseconds. Without nvcc, or with a CPU build of
    torch, this is a CPU-only build (said plainly).
    """
    # here, not at the top: the build modules (filelock, the toolchain probe) cost every start
    # of the CLI, --help included, ~40 ms
    from qwen_kvprep.steps import prebuilt
    from qwen_kvprep.steps.build import build_into_cache

    if lock_source and fetch_source:
        raise UsageError("--lock and --fetch are separate steps: run one, then the other")
    if lock_source or fetch_source:
        if export_dir or force or source_dir or arch:
            raise UsageError(
                "--lock and --fetch compile nothing: --export, --force, --source-dir and "
                "--arch mean nothing with them"
            )
        done = (
            prebuilt.write_lock(lock_source, lock_file.absolute())
            if lock_source
            else prebuilt.fetch_all(str(fetch_source), progress=False
                                    if output_options().as_json or quiet else None)
        )
        finish(done.findings, quiet, **done.fields)
    # a log (docker build, CI) gets a line a notice and a heartbeat while compiling
    with (None if quiet else step_log("build")) or nullcontext() as log:
        built = build_into_cache(source_dir, arch, Path(cache_dir) if cache_dir else None,
                                 force, lock_timeout, log, quiet)
    if export_dir is not None:
        done = prebuilt.export_build(
            export_dir.absolute(),
            prebuilt.Outcome(built.findings, built.to_json()),
            built.result,
            source_dir,
        )
        finish(done.findings, quiet, **done.fields)
    finish(built.findings, quiet, **built.to_json())


def register(group: click.Group) -> None:
    group.add_command(build)
