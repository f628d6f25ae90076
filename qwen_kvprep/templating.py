"""Deployment files for qwen-kvprep: a Dockerfile that builds the kernel in the image, a
shell entrypoint that runs prestart, and a Kubernetes Deployment whose init container
prepares a view of a read-only model volume. The files are templates in templates/; every
value put into them is validated here."""

from __future__ import annotations

import json
import re
import shlex
import string
from pathlib import Path
from typing import TYPE_CHECKING, Optional, TypedDict

from qwen_kvprep import __version__
from qwen_kvprep.common import ARCH_LIST_FIX, read_arch_list
from qwen_kvprep.errors import UsageError, os_failure
from qwen_kvprep.fsutil import atomic_write_text, check_output_file
from qwen_kvprep.resources import templates_dir

if TYPE_CHECKING:
    from typing_extensions import Unpack

# kind -> template file in templates/
TEMPLATES = {
    "docker": "Dockerfile.tmpl",
    "entrypoint": "entrypoint.sh.tmpl",
    "k8s": "k8s.yaml.tmpl",
}
# kind -> template file for --prebuilt (no nvcc in the image, no shared build cache)
PREBUILT_TEMPLATES = {
    "docker": "Dockerfile.prebuilt.tmpl",
    "k8s": "k8s.prebuilt.yaml.tmpl",
}
LOCKED_AT = "/opt/qwen-kvprep"  # where the docker template copies a lock file
DEFAULT_MODEL_DIR = "/models/Qwen-7B-Chat"
# Where the view of the model directory is prepared unless --view-dir says: the model volume
# is read-only in production (docker's `-v …:ro`, k8s' readOnly claim), so docker and k8s
# always serve through a view. k8s mounts an emptyDir there; an image keeps it in the
# container's own writable layer. The entrypoint serves what the user's command loads.
VIEW_ROOTS = {"docker": "/var/lib/qwen-kvprep", "k8s": "/prepared"}
# One cubin per major covers the family (8.0 runs on A10/L4/L40 too); PTX on the newest
# lets later GPUs JIT it. V100/T4 need 7.0 added (with CUDA 12.x: CUDA 13 dropped Volta).
DEFAULT_ARCH = "8.0;9.0+PTX"
DEFAULT_IMAGE = "registry.example.com/qwen-server:latest"
DEFAULT_CACHE = "/opt/qwen-kvprep/cache"
DEFAULT_CUDA = "12.4.1"
DEFAULT_TORCH = "2.5.1"

# Values land unquoted in YAML, a Dockerfile and a shell script: allow only characters
# that mean nothing special in any of them, rather than escaping for three languages.
# (--arch is not here: it is written as build reads it, digits, ".", "a", "f", "+PTX", ";".)
_SAFE = {
    "path": re.compile(r"^/[A-Za-z0-9_./-]*$"),
    "image": re.compile(r"^[A-Za-z0-9_./:@-]+$"),
    # --cuda names an nvidia/cuda tag (12.4.1, 12.4.1-cudnn) and, by its first two
    # numbers, torch's wheel index (cu124)
    "cuda": re.compile(r"^[0-9]+\.[0-9]+[A-Za-z0-9_.+-]*$"),
    "version": re.compile(r"^[0-9][A-Za-z0-9_.+-]*$"),
    "name": re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"),
    # a Hub repo ORG/NAME[@REVISION], or a lock file beside the Dockerfile
    "prebuilt": re.compile(
        r"^(?:[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*(?:@[A-Za-z0-9_.-]+)?"
        r"|[A-Za-z0-9][A-Za-z0-9_.-]*\.json)$"
    ),
}


def wheel_name() -> str:
    """The file name of qwen-kvprep's wheel for this version, as `pip wheel` makes it."""
    return f"qwen_kvprep-{__version__}-py3-none-any.whl"


def installed_from() -> Optional[tuple[str, str]]:
    """Where the qwen-kvprep running here was installed from, as pip recorded it
    (direct_url.json): ("dir", a checkout), ("wheel", a .whl) or ("archive", an sdist);
    None for an index install or when pip recorded nothing."""
    import importlib.metadata
    from urllib.parse import unquote, urlparse

    try:
        raw = importlib.metadata.distribution("qwen-kvprep").read_text("direct_url.json")
        data = json.loads(raw) if raw else None
    except (importlib.metadata.PackageNotFoundError, OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    url = data.get("url")
    if not isinstance(url, str) or not url.startswith("file://"):
        return None
    path = unquote(urlparse(url).path)
    if not path or any(c in path for c in "\n\r"):
        return None
    if "dir_info" in data:
        return "dir", path
    return ("wheel" if path.endswith(".whl") else "archive"), path


def wheel_command() -> str:
    """The command that puts qwen-kvprep's wheel beside the Dockerfile, made from the copy
    installed here: qwen-kvprep is not on PyPI, so the image installs what the user has."""
    source = installed_from()
    if source is None:
        return "pip wheel --no-deps -w . /path/to/qwen-kvprep    # your copy of its source"
    kind, path = source
    if kind == "wheel" and Path(path).name == wheel_name():
        return f"cp {shlex.quote(path)} ."
    return f"pip wheel --no-deps -w . {shlex.quote(path)}"


_PATH_EXAMPLES = {
    "--model-dir": DEFAULT_MODEL_DIR,
    "--view-dir": f"{VIEW_ROOTS['docker']}/Qwen-7B-Chat",
    "--cache-dir": DEFAULT_CACHE,
}
# kind -> what a value refused by _SAFE[kind] is not, and how to give one that is
_REFUSED = {
    "path": ("has characters the templates cannot hold unquoted",
             "use letters, digits and . _ - /"),
    "image": ("is not an image name the templates can hold unquoted",
              f"use letters, digits and . _ - / : @, e.g. --image {DEFAULT_IMAGE}"),
    "cuda": ("is not a CUDA version like 12.4.1",
             f"give the version of the nvidia/cuda images to build on, e.g. --cuda {DEFAULT_CUDA}"),
    "version": ("is not a version number like 2.5.1",
                f"give a torch release, e.g. --torch {DEFAULT_TORCH}"),
    "name": ("is not a DNS-1123 name (the Deployment's)",
             "use lower-case letters, digits and -, at most 63, starting and ending with a "
             "letter or digit"),
    "prebuilt": ("is neither a Hub repo ORG/NAME[@REVISION] nor a lock file NAME.json",
                 "e.g. --prebuilt my-org/qwen-kvprep-kernels, or --prebuilt kvprep.lock.json "
                 "for a lock file beside the Dockerfile"),
}


def _checked(kind: str, option: str, value: str) -> str:
    if kind == "path" and not value.startswith("/"):
        # where things are inside the container: a path relative to what would be unknowable
        raise UsageError(
            f"{option} {value!r} is a relative path; the templates need where it is inside "
            "the container",
            fix=f"give the absolute path, e.g. {option} {_PATH_EXAMPLES[option]}",
        )
    if not _SAFE[kind].match(value):
        problem, fix = _REFUSED[kind]
        raise UsageError(f"{option} {value!r} {problem}", fix=fix)
    return value


def _arch(value: str) -> str:
    """--arch as build reads it, written out that way ("sm_80,Hopper" -> "8.0;9.0+PTX"):
    an empty list is refused too, since the image build has no GPU to pick one from."""
    try:
        return ";".join(read_arch_list(value, "--arch"))
    except ValueError as exc:
        raise UsageError(str(exc), fix=ARCH_LIST_FIX) from None


def _serving_name(path: str, option: str) -> None:
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
    prebuilt: Optional[str] = None,
) -> dict[str, str]:
    """Every $name the templates use, validated."""
    model_dir = _checked("path", "--model-dir", model_dir.rstrip("/") or "/")
    model_name = Path(model_dir).name
    if view_dir is None and kind in VIEW_ROOTS:
        # the view's name is a module name for transformers: no dot
        view_dir = f"{VIEW_ROOTS[kind]}/{model_name.replace('.', '_')}"
    if view_dir is not None:
        view_dir = _checked("path", "--view-dir", view_dir.rstrip("/"))
    serve_dir = view_dir or model_dir
    _serving_name(serve_dir, "--view-dir" if view_dir else "--model-dir")
    if name is None:
        name = re.sub(r"[^a-z0-9-]+", "-", model_name.lower()).strip("-") or "qwen"
    if view_dir:
        output_export = (
            f'QWEN_KVPREP_OUTPUT="${{QWEN_KVPREP_OUTPUT:-{view_dir}}}"\n'
            "export QWEN_KVPREP_OUTPUT"
        )
    else:
        hint = f"{VIEW_ROOTS['docker']}/{model_name.replace('.', '_')}"
        output_export = f"# read-only MODEL_DIR: export QWEN_KVPREP_OUTPUT={hint}"
    cuda = _checked("cuda", "--cuda", cuda)
    return {
        **_prebuilt_variables(prebuilt),
        "tool_version": __version__,
        "wheel_name": wheel_name(),
        "wheel_command": wheel_command(),
        "model_dir": model_dir,
        "model_name": model_name,
        "view_dir": view_dir or "",
        "serve_dir": serve_dir,
        "arch": _arch(arch),
        "image": _checked("image", "--image", image),
        "cache_dir": _checked("path", "--cache-dir", cache_dir.rstrip("/")),
        "cuda": cuda,
        "torch_cuda_tag": "cu" + "".join(cuda.split("-")[0].split(".")[:2]),
        "torch": _checked("version", "--torch", torch),
        "name": _checked("name", "--name", name),
        "replicas": str(int(replicas)),
        "model_claim": f"{name}-models",
        "output_export": output_export,
    }


def _prebuilt_variables(prebuilt: Optional[str]) -> dict[str, str]:
    """$prebuilt_source (what fix and prestart are given), $prebuilt_where (for people),
    $prebuilt_copy and $prebuilt_context (a lock file is copied into the image)."""
    if prebuilt is None:
        return {}
    prebuilt = _checked("prebuilt", "--prebuilt", prebuilt)
    if prebuilt.endswith(".json"):
        inside = f"{LOCKED_AT}/{prebuilt}"
        return {
            "prebuilt_source": inside,
            "prebuilt_where": f"the Hub repo pinned by the lock file {prebuilt}",
            "prebuilt_copy": f"COPY {prebuilt} {inside}",
            "prebuilt_context": f" and the lock file {prebuilt} (`qwen-kvprep build --lock "
            f"ORG/NAME --lock-file {prebuilt}`)",
        }
    return {
        "prebuilt_source": prebuilt,
        "prebuilt_where": f"the Hub repo {prebuilt}",
        "prebuilt_copy": "# (to pin the repo's revision and digests: `qwen-kvprep build --lock "
        f"{prebuilt}` and render with --prebuilt kvprep.lock.json)",
        "prebuilt_context": "",
    }


class TemplateOptions(TypedDict, total=False):
    """The keyword arguments of `render`: those of `variables` after `kind`."""

    model_dir: str
    arch: str
    image: str
    view_dir: Optional[str]
    cache_dir: str
    cuda: str
    torch: str
    name: Optional[str]
    replicas: int
    prebuilt: Optional[str]


def render(kind: str, **options: Unpack[TemplateOptions]) -> str:
    files = TEMPLATES
    if options.get("prebuilt") is not None:
        if kind not in PREBUILT_TEMPLATES:
            raise UsageError(
                f"--prebuilt is for {' and '.join(PREBUILT_TEMPLATES)}; the {kind} template "
                "reads QWEN_KVPREP_PREBUILT from the environment instead",
                fix="drop --prebuilt (and set QWEN_KVPREP_PREBUILT where it runs)",
            )
        files = PREBUILT_TEMPLATES
    text = (templates_dir() / files[kind]).read_text(encoding="utf-8")
    # substitute (not safe_substitute): a $name the code does not provide is a bug here,
    # not something to ship to a user's Dockerfile.
    return string.Template(text).substitute(variables(kind, **options))


def write(path: str, kind: str, text: str) -> None:
    """The rendered file at `path` (an entrypoint executable); a usage error when its folder
    does not exist or something other than a regular file is there."""
    check_output_file(
        Path(path), "--output", fix="name a regular file, or leave out -o to print to stdout"
    )
    try:
        atomic_write_text(path, text, mode=0o755 if kind == "entrypoint" else None)
    except OSError as exc:
        # named after the file asked for, not the temporary file the write failed on
        raise os_failure(OSError(exc.errno, exc.strerror, path), output_option=False) from exc
