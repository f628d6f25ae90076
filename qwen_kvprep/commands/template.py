from __future__ import annotations

import re
import string
from pathlib import Path
from typing import Any, Optional

import click

from qwen_kvprep import __version__

# kind -> template file in templates/
TEMPLATES = {
    "docker": "Dockerfile.tmpl",
    "entrypoint": "entrypoint.sh.tmpl",
    "k8s": "k8s.yaml.tmpl",
}
DEFAULT_MODEL_DIR = "/models/Qwen-7B-Chat"
# One cubin per major covers the family (8.0 runs on A10/L4/L40 too); PTX on the newest
# lets later GPUs JIT it. V100/T4 need 7.0 added (with CUDA 12.x: CUDA 13 dropped Volta).
DEFAULT_ARCH = "8.0;9.0+PTX"
DEFAULT_IMAGE = "registry.example.com/qwen-server:latest"
DEFAULT_CACHE = "/opt/qwen-kvprep/cache"
DEFAULT_CUDA = "12.4.1"
DEFAULT_TORCH = "2.5.1"

# Values land unquoted in YAML, a Dockerfile and a shell script: allow only characters
# that mean nothing special in any of them, rather than escaping for three languages.
_SAFE = {
    "path": re.compile(r"^/[A-Za-z0-9_./-]*$"),
    "arch": re.compile(r"^[A-Za-z0-9_.;+ ]+$"),
    "image": re.compile(r"^[A-Za-z0-9_./:@-]+$"),
    "version": re.compile(r"^[0-9][A-Za-z0-9_.+-]*$"),
    "name": re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"),
}


def _checked(kind: str, option: str, value: str) -> str:
    from qwen_kvprep.errors import UsageError

    if not _SAFE[kind].match(value):
        raise UsageError(
            f"{option} {value!r} has characters the templates cannot hold unquoted",
            fix="use letters, digits and . _ - / (absolute paths; a DNS-1123 name for --name)",
        )
    return value


def _serving_name(path: str, option: str) -> None:
    from qwen_kvprep.errors import UsageError

    # transformers imports remote code from a module named after the model folder.
    if "." in Path(path).name:
        raise UsageError(
            f"{option} {path}: the folder the server loads must not have a dot in its name",
            fix="rename it (e.g. Qwen-1_8B-Chat), or prepare a view with --view-dir",
        )


def variables(
    kind: str,
    model_dir: str = DEFAULT_MODEL_DIR,
    arch: str = DEFAULT_ARCH,
    image: str = DEFAULT_IMAGE,
    view_dir: Optional[str] = None,
    cache_dir: str = DEFAULT_CACHE,
    cuda: str = DEFAULT_CUDA,
    torch: str = DEFAULT_TORCH,
    name: Optional[str] = None,
    replicas: int = 2,
) -> dict[str, str]:
    """Every $name the templates use, validated."""
    model_dir = _checked("path", "--model-dir", model_dir.rstrip("/") or "/")
    model_name = Path(model_dir).name
    if kind == "k8s" and view_dir is None:
        # in Kubernetes the model volume is mounted read-only: always serve from a view
        view_dir = f"/prepared/{model_name.replace('.', '_')}"
    if view_dir is not None:
        view_dir = _checked("path", "--view-dir", view_dir.rstrip("/"))
    serve_dir = view_dir or model_dir
    _serving_name(serve_dir, "--view-dir" if view_dir else "--model-dir")
    if name is None:
        name = re.sub(r"[^a-z0-9-]+", "-", model_name.lower()).strip("-") or "qwen"
    if view_dir:
        output_env = f"ENV QWEN_KVPREP_OUTPUT={view_dir}"
        output_export = (
            f'QWEN_KVPREP_OUTPUT="${{QWEN_KVPREP_OUTPUT:-{view_dir}}}"\n'
            "export QWEN_KVPREP_OUTPUT"
        )
    else:
        hint = f"/var/lib/qwen-kvprep/{model_name.replace('.', '_')}"
        output_env = f"# ENV QWEN_KVPREP_OUTPUT={hint}   (read-only model volume)"
        output_export = f"# read-only MODEL_DIR: export QWEN_KVPREP_OUTPUT={hint}"
    cuda = _checked("version", "--cuda", cuda)
    return {
        "tool_version": __version__,
        "model_dir": model_dir,
        "model_name": model_name,
        "view_dir": view_dir or "",
        "serve_dir": serve_dir,
        "arch": _checked("arch", "--arch", arch),
        "image": _checked("image", "--image", image),
        "cache_dir": _checked("path", "--cache-dir", cache_dir.rstrip("/")),
        "cuda": cuda,
        "torch_cuda_tag": "cu" + "".join(cuda.split(".")[:2]),
        "torch": _checked("version", "--torch", torch),
        "name": _checked("name", "--name", name),
        "replicas": str(int(replicas)),
        "model_claim": f"{name}-models",
        "output_env": output_env,
        "output_export": output_export,
    }


def render(kind: str, **options: Any) -> str:
    from qwen_kvprep.resources import templates_dir

    text = (templates_dir() / TEMPLATES[kind]).read_text(encoding="utf-8")
    # substitute (not safe_substitute): a $name the code does not provide is a bug here,
    # not something to ship to a user's Dockerfile.
    return string.Template(text).substitute(variables(kind, **options))


@click.command()
@click.argument("kind", type=click.Choice(sorted(TEMPLATES)))
@click.option("--model-dir", default=DEFAULT_MODEL_DIR, show_default=True,
              help="Where the model directory is inside the container.")
@click.option("--arch", default=DEFAULT_ARCH, show_default=True,
              help="CUDA architectures the image build compiles for (no GPU there).")
@click.option("--image", default=DEFAULT_IMAGE, show_default=True,
              help="The image name (k8s; a comment in the Dockerfile).")
@click.option("--view-dir", metavar="DIR",
              help="Read-only model directory: prepare a view here and serve from it "
              "(k8s always does: /prepared/<model name>).")
@click.option("--cache-dir", default=DEFAULT_CACHE, show_default=True,
              help="Build cache baked into the image (docker).")
@click.option("--cuda", default=DEFAULT_CUDA, show_default=True,
              help="CUDA version of the nvidia/cuda base images (docker).")
@click.option("--torch", "torch_version", default=DEFAULT_TORCH, show_default=True,
              help="torch version to install (docker).")
@click.option("--name", help="Deployment name (k8s; default: from the model folder name).")
@click.option("--replicas", type=click.IntRange(1), default=2, show_default=True,
              help="Replicas (k8s).")
@click.option("-o", "--out-file", type=click.Path(dir_okay=False), metavar="FILE",
              help="Write to FILE instead of stdout.")
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
    out_file: Optional[str],
) -> None:
    """Print a deployment file: docker (multi-stage Dockerfile that builds the kernel in the
    image), entrypoint (shell entrypoint running prestart), k8s (Deployment whose init
    container prepares a view of a read-only model volume; shared build cache)."""
    from qwen_kvprep.fsutil import atomic_write_text
    from qwen_kvprep.report import emit

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
    )
    if out_file is None:
        emit(text.rstrip("\n"))
        return
    atomic_write_text(out_file, text, mode=0o755 if kind == "entrypoint" else None)
    click.echo(f"wrote {out_file}", err=True)


def register(group: click.Group) -> None:
    group.add_command(template)
