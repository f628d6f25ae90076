"""What prestart's quick start and the rest of qwen-kvprep share: the names of the files and
folders qwen-kvprep writes, sha256, the Python tag, where the build cache and transformers'
modules cache are, the GPU architecture lists torch reads, and the CUDA toolkit as torch
resolves it.

prestart's quick start imports this module on every container start: standard library only (and
qwen_kvprep.untrusted, which the quick start reads with anyway and which is standard library
only itself), and nothing that costs milliseconds at import (no pathlib, typing,
dataclasses, hashlib; those that are needed by a function are imported inside it).
"""

from __future__ import annotations

import os
import sys

from qwen_kvprep.untrusted import open_regular, read_regular

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing costs milliseconds at import; only mypy needs it
    from collections.abc import Mapping
    from typing import Callable, Optional, Protocol

    class _Hash(Protocol):
        def update(self, data: bytes, /) -> None: ...
        def hexdigest(self) -> str: ...

# ------------------------------------------------------------------ names

# `<checkpoint>/.qwen-kvprep/`: the journal, the originals, the recorded state, the lock.
STATE_DIRNAME = ".qwen-kvprep"
STATE_FILE = "state.json"
JOURNAL_FILE = "journal.json"
LOCK_FILE = "lock"  # the folder's lock (dirlock.py), shared by fix, prestart and revert
# In a modules-cache folder: one file per prepared folder that relies on what is planted.
USERS_DIRNAME = ".qwen-kvprep-users"
# how often a record is written again into USERS_DIRNAME after another checkpoint's fix
# pruned it while it was still empty (checkpoints share transformers_modules/ itself)
REGISTER_TRIES = 20
# The kernel sources Qwen's remote code compiles: (the C++ binding, the CUDA kernels).
KERNEL_FILES = ("cache_autogptq_cuda_256.cpp", "cache_autogptq_cuda_kernel_256.cu")
# The checkpoint's module that builds and loads the kernels; fix replaces it with its loader,
# which carries LOADER_MARKER in its first lines (templates/cpp_kernels.py.tmpl).
LOADER_FILE = "cpp_kernels.py"
LOADER_MARKER = "# qwen-kvprep loader"
# What fix may change in a checkpoint (the state records their hashes), and what it plants
# into transformers' modules cache.
# The Int8 cache's fast path (templates/qwen_kvprep_kv.py), planted beside the loader, and
# the model code whose last lines fix adds to import it (fastkv.py).
FAST_FILE = "qwen_kvprep_kv.py"
MODELING_FILE = "modeling_qwen.py"
# What Qwen's code needs from the running transformers (templates/qwen_kvprep_compat.py),
# written beside modeling_qwen.py, which imports it relatively (compat.py): transformers
# copies it into the modules cache itself.
COMPAT_FILE = "qwen_kvprep_compat.py"
TRACKED_FILES = (
    "config.json", LOADER_FILE, *KERNEL_FILES, FAST_FILE, COMPAT_FILE, MODELING_FILE
)
MODULE_FILES = (*KERNEL_FILES, LOADER_FILE, FAST_FILE)

# transformers names a local checkpoint's modules-cache folder after the last part of its
# path as written and imports the code under a module name made from it: a path ending in
# `..` never imports; one ending in `.` (`.`, `DIR/.`) does only from 4.39 on, which
# normalises that name (docs/qwen-v1.md has the measurements).
DOT_SPELLING_FIXED_IN = (4, 39)


def spelling_problem(spelt: str, transformers_version: Optional[str]) -> Optional[str]:
    """Why transformers cannot load a checkpoint by the path `spelt` as written (None: it
    can, or the version that decides is unknown)."""
    last = spelt.rstrip("/").rsplit("/", 1)[-1] if spelt.rstrip("/") else spelt
    if spelt.endswith("/") and last not in (".", ".."):
        return None
    if last == "..":
        return (
            "the path ends in `..`, so transformers imports the remote code from outside its "
            "modules package and fails (`ImportError: attempted relative import with no known "
            "parent package`; 4.32 to 4.38: `ModuleNotFoundError: No module named "
            "'transformers_modules.'`)"
        )
    if last == "." and transformers_version:
        parts = transformers_version.split(".")
        try:
            version = (int(parts[0]), int(parts[1]))
        except (IndexError, ValueError):
            return None
        if version < DOT_SPELLING_FIXED_IN:
            return (
                f"the path ends in `.`, which transformers {transformers_version} turns into "
                "the module name `transformers_modules.` and fails (`ModuleNotFoundError: No "
                "module named 'transformers_modules.'`; transformers 4.39 and later load it)"
            )
    return None


# The GPTQ backend for Int4 checkpoints (docs/reference.md, "Int4 GPTQ checkpoints"), by
# the transformers it must serve:
# - transformers >= 5.4: optimum >= 2.3 with gptqmodel >= 7 (pure Python; its kernels come
#   from torch and Triton at run time). gptqmodel's newest release may ask for a newer torch
#   or transformers than the user has: the command pins the installed ones, so pip picks the
#   gptqmodel that fits the stack instead of replacing it (7.6.0 for torch 2.13).
# - transformers < 4.54: gptqmodel 2.2.0 (its last release that accepts them) with
#   optimum < 2.1. It ships only a source archive whose setup.py imports torch, so pip
#   must build it without build isolation; with no GPU visible (and no
#   TORCH_CUDA_ARCH_LIST) it builds pure Python, and FORCE_BUILD skips its attempt to fetch
#   a prebuilt wheel from GitHub. The bounds of transformers and huggingface-hub are
#   repeated because gptqmodel's own requirements would pull transformers 5.
# - 4.54 to 5.3 has no measured backend: the current one, with transformers 5 (which runs
#   Qwen v1 through qwen-kvprep's compatibility module).
GPTQ_CURRENT = ("optimum>=2.3", "gptqmodel>=7")
GPTQ_LEGACY = ("optimum>=1.24,<2.1", "gptqmodel==2.2.0")
CURRENT_GPTQ_TRANSFORMERS = (5, 4)


def _release(version: str) -> tuple[int, int]:
    parts = [*version.split("."), "0"][:2]
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)
    except ValueError:
        return 0, 0


def _installed(dist: str) -> Optional[str]:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _quoted(requirements: tuple[str, ...]) -> str:
    return " ".join(f'"{r}"' for r in requirements)


def gptq_install(
    transformers: Optional[str] = None, torch: Optional[str] = None, here: bool = True
) -> str:
    """The pip command that installs the GPTQ backend for this stack (transformers and torch
    as given, or, with `here`, as installed) without changing either."""
    if here:
        transformers = transformers or _installed("transformers")
        torch = torch or _installed("torch")
    if transformers is not None and _release(transformers) < (4, 54):
        return (
            "pip install setuptools wheel && CUDA_VISIBLE_DEVICES= GPTQMODEL_FORCE_BUILD=1 "
            "pip install --no-build-isolation " + _quoted(GPTQ_LEGACY)
            + ' "transformers>=4.49,<4.54" "huggingface-hub<1.0"'
        )
    keep = [f"torch=={torch}"] if torch else []
    if transformers is not None and _release(transformers) >= CURRENT_GPTQ_TRANSFORMERS:
        keep.append(f"transformers=={transformers}")
    else:
        keep.append(f"transformers>={CURRENT_GPTQ_TRANSFORMERS[0]}.{CURRENT_GPTQ_TRANSFORMERS[1]}")
    return "pip install " + _quoted((*GPTQ_CURRENT, *keep))


ENV_CACHE = "QWEN_KVPREP_CACHE"  # the build cache
ENV_LOCK_TIMEOUT = "QWEN_KVPREP_LOCK_TIMEOUT"  # waiting for another builder or fix

# The files the state tracks are a few KiB; never hash anything big (weights) on the quick start.
SMALL_FILE_LIMIT = 16 << 20

# ------------------------------------------------------------------ sha256


def _sha256_constructor() -> Callable[[bytes], _Hash]:
    # The interpreter's builtin sha256 (_sha2 from 3.12, _sha256 before): hashlib would
    # first load OpenSSL's libcrypto, several milliseconds of the quick start. Same digest.
    for name in ("_sha2", "_sha256"):
        try:
            builtin: Callable[[bytes], _Hash] = __import__(name).sha256
            return builtin
        except (ImportError, AttributeError):
            continue
    import hashlib

    return hashlib.sha256


_builtin_sha256 = _sha256_constructor()


def sha256_small(path: str) -> Optional[str]:
    """sha256 of a small regular file; None when it is missing, unreadable, not small or
    not a regular file (a FIFO is refused without waiting for a writer)."""
    try:
        data = read_regular(path, SMALL_FILE_LIMIT)
    except OSError:
        return None
    return str(_builtin_sha256(data).hexdigest())


def user_record_name(prepared: str) -> str:
    """The file in a modules-cache folder's USERS_DIRNAME that says the prepared folder
    `prepared` (an absolute path) relies on what is planted there."""
    digest = _builtin_sha256(prepared.encode("utf-8", "surrogateescape")).hexdigest()
    return f"{digest[:16]}.json"


def fix_command(directory: object, read_only: bool = False) -> str:
    """The command that runs fix on the checkpoint folder `directory`, quoted for a shell:
    the advice wherever fix puts a problem right. A folder fix cannot write (`read_only`)
    is fixed as a view in a folder of its own (view_folder), which the server then loads."""
    import shlex  # only advice needs it; the quick start never gives any

    if read_only:
        out = shlex.quote(view_folder(directory))
        return f"qwen-kvprep fix -o {out} {shlex.quote(str(directory))}"
    return f"qwen-kvprep fix {shlex.quote(str(directory))}"


def prestart_command(directory: object) -> str:
    """The command a server started through prepares its environment with (the modules
    cache, a build for its torch): the advice where a load cannot serve the prepared folder
    by itself. CMD stands for the server's own command."""
    import shlex

    return f"qwen-kvprep prestart {shlex.quote(str(directory))} -- CMD"


def view_folder(directory: object) -> str:
    """Where advice prepares the view of a read-only checkpoint folder: under the home
    folder (the model's mount is read-only, and so may be the working directory), named
    after it without dots (a dot in OUT's name breaks transformers' module import)."""
    name = os.path.basename(os.path.normpath(os.path.abspath(str(directory))))
    return os.path.join(os.path.expanduser("~"), "qwen-kvprep-views", name.replace(".", "_"))


def sha256_bytes(data: bytes) -> str:
    import hashlib  # OpenSSL's: faster than the builtin one on large inputs

    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike[str]) -> str:
    """sha256 of a regular file of any size (symlinks followed); OSError for anything else,
    without blocking on a FIFO (untrusted.NotRegularFile)."""
    import hashlib

    h = hashlib.sha256()
    fd = open_regular(path)
    try:
        for chunk in iter(lambda: os.read(fd, 1 << 20), b""):
            h.update(chunk)
    finally:
        os.close(fd)
    return h.hexdigest()


# ------------------------------------------------------------------ this interpreter
# python_tag() and machine() are repeated verbatim in templates/cpp_kernels.py.tmpl (the
# loader must not need qwen-kvprep installed); tests check both give the same answer.


def python_tag() -> str:
    # "cp311", "cp313t": the interpreter and its ABI flags (debug, free-threaded) are
    # what an extension module is bound to.
    impl = "cp" if sys.implementation.name == "cpython" else sys.implementation.name
    return f"{impl}{sys.version_info[0]}{sys.version_info[1]}{getattr(sys, 'abiflags', '')}"


def machine() -> str:
    # "linux-x86_64", "linux-aarch64", "macosx-14.0-arm64": OS and CPU architecture.
    import sysconfig

    return sysconfig.get_platform()


# ------------------------------------------------------------------ cache roots


def _absolute(path: str) -> str:
    # As pathlib's absolute(): joined to the working directory, ".." kept as written.
    return path if os.path.isabs(path) else os.path.join(os.getcwd(), path)


def build_cache_root(
    option: Optional[str | os.PathLike[str]] = None,
    environ: Optional[Mapping[str, str]] = None,
) -> tuple[str, str]:
    """qwen-kvprep's build cache, absolute, and what chose it: --cache-dir >
    $QWEN_KVPREP_CACHE > $XDG_CACHE_HOME/qwen-kvprep > ~/.cache/qwen-kvprep."""
    env = os.environ if environ is None else environ
    if option is not None:
        return _absolute(os.path.expanduser(os.fspath(option))), "--cache-dir"
    if env.get(ENV_CACHE):
        return _absolute(os.path.expanduser(env[ENV_CACHE])), ENV_CACHE
    if env.get("XDG_CACHE_HOME"):
        xdg = os.path.expanduser(env["XDG_CACHE_HOME"])
        return _absolute(os.path.join(xdg, "qwen-kvprep")), "XDG_CACHE_HOME"
    home = os.path.expanduser("~")
    return _absolute(os.path.join(home, ".cache", "qwen-kvprep")), "default"


def modules_cache_root(environ: Optional[Mapping[str, str]] = None) -> tuple[str, str]:
    """Where transformers keeps the remote code it runs, read from the environment (no
    transformers import), and what chose it: HF_MODULES_CACHE > $HF_HOME/modules >
    $XDG_CACHE_HOME/huggingface/modules > ~/.cache/huggingface/modules (huggingface_hub
    derives HF_HOME from XDG_CACHE_HOME when HF_HOME is unset). Not made absolute: a
    relative value is relative to the working directory, as for transformers."""
    env = os.environ if environ is None else environ
    if env.get("HF_MODULES_CACHE"):
        return os.path.expanduser(env["HF_MODULES_CACHE"]), "HF_MODULES_CACHE"
    if env.get("HF_HOME"):
        return os.path.join(os.path.expanduser(env["HF_HOME"]), "modules"), "HF_HOME"
    if env.get("XDG_CACHE_HOME"):
        xdg = os.path.expanduser(env["XDG_CACHE_HOME"])
        return os.path.join(xdg, "huggingface", "modules"), "XDG_CACHE_HOME"
    home = os.path.expanduser("~")
    return os.path.join(home, ".cache", "huggingface", "modules"), "default"


# ------------------------------------------------------------------ GPU architectures
# `--arch`, QWEN_KVPREP_ARCH and TORCH_CUDA_ARCH_LIST are read by one grammar: what torch's
# cpp_extension takes for TORCH_CUDA_ARCH_LIST (compute capabilities such as 8.0, 9.0a,
# 8.6+PTX, separated by `;` or spaces, and the family names below), and the spellings
# qwen-kvprep has always taken besides (commas; sm_80, compute_90a, 80, a lower-case +ptx).
# Here, not in buildcache/arch.py: prestart's quick start checks QWEN_KVPREP_ARCH, and the
# CLI checks --arch as it parses it, neither of which may import the build cache.

# TORCH_CUDA_ARCH_LIST's family names, expanded as torch 2.13's cpp_extension expands them
# (older torch knows fewer). Read in any case (`ampere`): torch matches the exact case, but
# it is only ever given the capabilities they expand to.
ARCH_NAMES = {
    "Kepler+Tesla": ("3.7",),
    "Kepler": ("3.5+PTX",),
    "Maxwell+Tegra": ("5.3",),
    "Maxwell": ("5.0", "5.2+PTX"),
    "Pascal": ("6.0", "6.1+PTX"),
    "Volta+Tegra": ("7.2",),
    "Volta": ("7.0+PTX",),
    "Turing": ("7.5+PTX",),
    "Ampere+Tegra": ("8.7",),
    "Ampere": ("8.0", "8.6+PTX"),
    "Ada": ("8.9+PTX",),
    "Hopper": ("9.0+PTX",),
    "Blackwell+Tegra": ("11.0",),
    "Blackwell": ("10.0", "10.3", "12.0", "12.1+PTX"),
}
ARCH_LIST_FIX = (
    'give compute capabilities separated by ; or spaces, e.g. "8.0;9.0+PTX" or "8.6" '
    "(`nvidia-smi --query-gpu=compute_cap --format=csv` shows a GPU's), or a family name as "
    "torch takes it: Volta, Turing, Ampere, Ada, Hopper, Blackwell"
)
_ARCH_ENTRY = r"(?:sm_|compute_)?(\d+)\.?(\d)([af]?)(\+ptx)?"


def read_arch_list(text: str, origin: str) -> tuple[str, ...]:
    """ "8.0;9.0+PTX", "8.0 9.0", "sm_90a", "Ampere" -> ("8.0", "9.0+PTX"), ("8.0", "9.0"),
    ("9.0a",), ("8.0", "8.6+PTX"): normalised, each once, sorted by capability. A
    ValueError names `origin` and what cannot be read (an empty list included); callers
    raise it as a usage error with ARCH_LIST_FIX."""
    import re  # loaded anyway where this runs (json imports it); compiled once, cached

    out: list[str] = []
    for raw in re.split(r"[;,\s]+", text.strip()):
        if not raw:
            continue
        m = re.fullmatch(_ARCH_ENTRY, raw, re.IGNORECASE)
        family = next((n for n in ARCH_NAMES if n.lower() == raw.lower()), None)
        if family is not None:
            entries: tuple[str, ...] = ARCH_NAMES[family]
        elif m:
            major, minor, variant, ptx = m.groups()
            entries = (f"{int(major)}.{minor}{variant.lower()}" + ("+PTX" if ptx else ""),)
        else:
            raise ValueError(f"{origin}: {raw!r} is not a GPU architecture")
        out.extend(e for e in entries if e not in out)
    if not out:
        raise ValueError(f"{origin}: the architecture list is empty")
    return tuple(sorted(out, key=lambda a: (_capability(a), a)))


def _capability(entry: str) -> tuple[int, int]:
    major, minor = entry.split("+")[0].rstrip("af").split(".")
    return int(major), int(minor)


# ------------------------------------------------------------------ the CUDA toolkit

DEFAULT_CUDA_HOME = "/usr/local/cuda"


def resolve_cuda_home(
    environ: Mapping[str, str], which_nvcc: Optional[str]
) -> tuple[Optional[str], str]:
    """CUDA_HOME as torch.utils.cpp_extension._find_cuda_home resolves it: (path or None,
    where it came from).

    CUDA_HOME, else CUDA_PATH (taken verbatim, even when it is a path list), else the
    grandparent of `nvcc` on PATH (so /usr/local/bin/nvcc gives /usr/local), else
    /usr/local/cuda if it exists.
    """
    for name in ("CUDA_HOME", "CUDA_PATH"):
        value = environ.get(name)
        if value:
            return value, name
    if which_nvcc:
        return os.path.dirname(os.path.dirname(which_nvcc)), "nvcc-on-path"
    if os.path.exists(DEFAULT_CUDA_HOME):
        return DEFAULT_CUDA_HOME, "default"
    return None, "none"


def _is_toolkit(home: str) -> bool:
    return os.path.exists(os.path.join(home, "bin", "nvcc")) and os.path.exists(
        os.path.join(home, "include", "cuda_runtime.h")
    )


def build_cuda_home(environ: Optional[Mapping[str, str]] = None) -> tuple[Optional[str], str]:
    """The CUDA toolkit qwen-kvprep builds with, and how it was found (or why none was).

    torch's answer (resolve_cuda_home) when it is a toolkit. CUDA_HOME / CUDA_PATH are the
    user's word: used when they hold bin/nvcc, never second-guessed. An nvcc found on PATH
    that is not inside a toolkit (/usr/local/bin/nvcc, a wrapper script exec'ing the real
    one: torch takes /usr/local and finds no cuda_runtime.h there) is followed through its
    symlinks, else /usr/local/cuda is taken. The builder passes the answer to torch as
    CUDA_HOME, so torch builds with the same toolkit.
    """
    import shutil

    env = os.environ if environ is None else environ
    on_path = shutil.which("nvcc", path=env.get("PATH"))
    home, source = resolve_cuda_home(env, on_path)
    if home is not None and source in ("CUDA_HOME", "CUDA_PATH"):
        if os.path.exists(os.path.join(home, "bin", "nvcc")):
            return home, f"{source}={home}"
        return None, f"{source}={home} has no bin/nvcc"
    if on_path:
        followed = os.path.dirname(os.path.dirname(os.path.realpath(on_path)))
        for candidate in (home, followed):
            if candidate is not None and _is_toolkit(candidate):
                return candidate, f"nvcc on PATH ({on_path})"
    if os.path.exists(os.path.join(DEFAULT_CUDA_HOME, "bin", "nvcc")):
        return DEFAULT_CUDA_HOME, DEFAULT_CUDA_HOME
    if on_path:
        return None, f"nvcc on PATH ({on_path}) is not inside a CUDA toolkit; set CUDA_HOME"
    return None, "no nvcc: CUDA_HOME is unset, nvcc is not on PATH, no /usr/local/cuda"
