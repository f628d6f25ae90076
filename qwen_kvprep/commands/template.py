from __future__ import annotations

import sys
from typing import Optional

import click

from qwen_kvprep.commands._common import json_option, output_options
from qwen_kvprep.commands._options import NonEmptyPath, cache_dir_option
from qwen_kvprep.errors import UsageError
from qwen_kvprep.render import emit, render_json
from qwen_kvprep.templating import (
    DEFAULT_ARCH,
    DEFAULT_CACHE,
    DEFAULT_CUDA,
    DEFAULT_IMAGE,
    DEFAULT_MODEL_DIR,
    DEFAULT_TORCH,
    TEMPLATES,
    render,
    write,
)


@click.command()
@click.argument("kind", type=click.Choice(sorted(TEMPLATES)))
@click.option("--model-dir", default=DEFAULT_MODEL_DIR, show_default=True,
              help="Where the model directory is inside the container.")
@click.option("--arch", default=DEFAULT_ARCH, show_default=True,
              help="CUDA architectures the image build compiles for (no GPU there).")
@click.option("--image", default=DEFAULT_IMAGE, show_default=True,
              help="The image name (k8s; a comment in the Dockerfile).")
@click.option("--view-dir", metavar="DIR",
              help="Where prestart prepares a view of the (read-only) model directory, which "
              "the server loads; docker and k8s always use one (default: "
              "/var/lib/qwen-kvprep/<model name>, k8s: /prepared/<model name>).")
@cache_dir_option(image_default=DEFAULT_CACHE)
@click.option("--cuda", default=DEFAULT_CUDA, show_default=True,
              help="CUDA version of the nvidia/cuda base images (docker).")
@click.option("--torch", "torch_version", default=DEFAULT_TORCH, show_default=True,
              help="torch version to install (docker).")
@click.option("--name", help="Deployment name (k8s; default: from the model folder name).")
@click.option("--replicas", type=click.IntRange(1), default=2, show_default=True,
              help="Replicas (k8s).")
@click.option("--prebuilt", metavar="SOURCE",
              help="Prebuilt kernels instead of compiling (docker, k8s): a Hub repo "
              "ORG/NAME[@REVISION] or a lock file beside the Dockerfile. The image has no "
              "nvcc and fetches every variant at build time; pods share no build cache.")
@click.option("-o", "--output", type=NonEmptyPath(dir_okay=False), metavar="FILE",
              help="Write to FILE instead of stdout.")
@click.option("--out-file", "out_file", type=click.Path(dir_okay=False), hidden=True,
              help="Deprecated spelling of -o/--output.")
@json_option
def template(
    kind: str,
    model_dir: str,
    arch: str,
    image: str,
    view_dir: Optional[str],
    cache_dir: str,
    cuda: str,
    torch_version: str,
    name: Optional[str],
    replicas: int,
    prebuilt: Optional[str],
    output: Optional[str],
    out_file: Optional[str],
) -> None:
    """Print (or write with -o FILE) a deployment file: docker (multi-stage Dockerfile
    that builds the kernel in the image), entrypoint (shell entrypoint running prestart),
    k8s (Deployment whose init container prepares a view of a read-only model volume;
    shared build cache). With --prebuilt, docker and k8s install prebuilt kernels instead:
    no nvcc in the image, no shared build cache."""
    text = render(
        kind,
        model_dir=model_dir,
        arch=arch,
        image=image,
        view_dir=view_dir,
        cache_dir=cache_dir,
        cuda=cuda,
        torch=torch_version,
        name=name,
        replicas=replicas,
        prebuilt=prebuilt,
    )
    if out_file is not None:
        # -o means the same in every command: where it writes what it makes (fix and
        # prestart: the view folder; here: the file)
        emit("qwen-kvprep template: --out-file is deprecated, use -o/--output", sys.stderr)
        if output is not None and output != out_file:
            raise UsageError("-o/--output and --out-file name different files",
                             fix="give -o FILE alone")
        output = out_file
    if output is not None:
        write(output, kind, text)
    if output_options().as_json:
        emit(render_json([], template={"kind": kind, "output": output, "text": text}))
    elif output is None:
        emit(text.rstrip("\n"))
    else:
        emit(f"wrote {output}", sys.stderr)


def register(group: click.Group) -> None:
    group.add_command(template)
