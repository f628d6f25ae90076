"""`prestart`: free when nothing changed since `fix`, the missing part of `fix` when it did.

It runs on every container start. The fast path — the state `fix` recorded still matches
the files, the installed torch/transformers, the build and the modules cache — must cost a
few milliseconds: this module imports only the standard library at the top (no pathlib,
typing, click, torch, transformers or huggingface_hub), and `qwen_kvprep.entry` calls
`fast()` before click is even imported. Everything else (the slow path: fix, locking,
rendering) is imported inside the functions that need it.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing/pathlib cost milliseconds at import; only mypy needs them
    from collections.abc import Sequence
    from typing import Any, Callable, NoReturn, Optional

# Every option has an environment variable, because entrypoints are configured that way.
ENV_DIR = "QWEN_KVPREP_DIR"
ENV_OUTPUT = "QWEN_KVPREP_OUTPUT"
ENV_SMOKE = "QWEN_KVPREP_SMOKE"
ENV_ALLOW_FALLBACK = "QWEN_KVPREP_ALLOW_FALLBACK"
ENV_CACHE = "QWEN_KVPREP_CACHE"  # the build cache (buildcache.resolve_cache_dir reads it too)
ENV_ARCH = "QWEN_KVPREP_ARCH"
ENV_SOURCE = "QWEN_KVPREP_SOURCE"
ENV_QUIET = "QWEN_KVPREP_QUIET"
ENV_LOCK_TIMEOUT = "QWEN_KVPREP_LOCK_TIMEOUT"
# Test/bench hook: where to write the names of the imported modules just before exec.
ENV_DEBUG_IMPORTS = "QWEN_KVPREP_DEBUG_IMPORTS"

STATE_DIRNAME = ".qwen-kvprep"  # journal.STATE_DIRNAME; not imported (fast path)
STATE_FILE = "state.json"
LOCK_FILE = "prestart.lock"
KERNEL_FILES = ("cache_autogptq_cuda_256.cpp", "cache_autogptq_cuda_kernel_256.cu")
TRACKED_FILES = ("config.json", "cpp_kernels.py", *KERNEL_FILES)
PACKAGES = ("torch", "transformers")
SOURCES = ("auto", "vendored", "hub")  # steps.sources.SOURCES
# The files the state tracks are a few KiB; never hash anything big (weights).
_SMALL = 16 << 20
# click's BoolParamType spellings, so an environment variable means the same on both paths.
_TRUE = ("1", "true", "t", "yes", "y", "on")
_FALSE = ("0", "false", "f", "no", "n", "off")
EXIT_NOT_FOUND = 127  # as a shell reports a command it cannot find
EXIT_NOT_EXECUTABLE = 126


class Request:
    """What one prestart call asks for, options and environment merged."""

    __slots__ = ("allow_fallback", "arch", "cache_dir", "command", "directory", "output",
                 "quiet", "smoke", "source")

    def __init__(
        self,
        directory: Optional[str],
        output: Optional[str] = None,
        smoke: bool = False,
        allow_fallback: bool = False,
        cache_dir: Optional[str] = None,
        arch: Optional[str] = None,
        quiet: bool = False,
        command: Sequence[str] = (),
        source: Optional[str] = None,
    ) -> None:
        self.directory = directory
        self.output = output
        self.smoke = smoke
        self.allow_fallback = allow_fallback
        self.cache_dir = cache_dir
        self.arch = arch
        self.quiet = quiet
        self.command = list(command)
        self.source = source

    @property
    def target(self) -> str:
        """The folder fix works on and the state lives in: OUT for a view, else DIR."""
        path = self.output if self.output else self.directory
        assert path is not None
        return os.path.abspath(path)


# ------------------------------------------------------------------ argument parsing


def env_flag(name: str) -> Optional[bool]:
    """A boolean environment variable as click reads it; None when unset or unreadable."""
    raw = os.environ.get(name, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    return None


def parse_fast(args: Sequence[str]) -> Optional[Request]:
    """Parse `prestart`'s arguments without click, or None for anything unusual (--help,
    an unknown option, a bad value...): click then parses them and reports the problem."""
    args = list(args)
    command: list[str] = []
    if "--" in args:
        cut = args.index("--")
        args, command = args[:cut], args[cut + 1 :]
    values: dict[str, Optional[str]] = {
        "--output": os.environ.get(ENV_OUTPUT) or None,
        "-o": None,
        "--cache-dir": os.environ.get(ENV_CACHE) or None,
        "--arch": os.environ.get(ENV_ARCH) or None,
        "--source": os.environ.get(ENV_SOURCE) or None,
    }
    flags: dict[str, Optional[bool]] = {
        "--smoke": env_flag(ENV_SMOKE) if os.environ.get(ENV_SMOKE, "").strip() else False,
        "--allow-fallback": env_flag(ENV_ALLOW_FALLBACK)
        if os.environ.get(ENV_ALLOW_FALLBACK, "").strip()
        else False,
        "--quiet": env_flag(ENV_QUIET) if os.environ.get(ENV_QUIET, "").strip() else False,
    }
    positional: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        name, eq, value = arg.partition("=")
        if name in values:
            if not eq:
                if i + 1 >= len(args):
                    return None
                i += 1
                value = args[i]
            values[name] = value
        elif arg == "-q":
            flags["--quiet"] = True
        elif arg in flags:
            flags[arg] = True
        elif arg.startswith("-"):
            return None
        else:
            positional.append(arg)
        i += 1
    if any(v is None for v in flags.values()) or len(positional) > 1:
        return None
    if values["--source"] not in (None, *SOURCES):
        return None
    directory = positional[0] if positional else (os.environ.get(ENV_DIR) or None)
    output = values["-o"] or values["--output"]
    if directory is None:
        return None
    return Request(
        directory,
        output=output,
        smoke=bool(flags["--smoke"]),
        allow_fallback=bool(flags["--allow-fallback"]),
        cache_dir=values["--cache-dir"],
        arch=values["--arch"],
        quiet=bool(flags["--quiet"]),
        command=command,
        source=values["--source"],
    )


# ------------------------------------------------------------------ the recorded state


def _sha256_constructor() -> Callable[[bytes], Any]:
    # The interpreter's builtin sha256 (_sha2 from 3.12, _sha256 before): hashlib would
    # first load OpenSSL's libcrypto, several milliseconds of the fast path. Same digest.
    for name in ("_sha2", "_sha256"):
        try:
            return __import__(name).sha256
        except (ImportError, AttributeError):
            continue
    import hashlib

    return hashlib.sha256


_sha256 = _sha256_constructor()


def sha256_small(path: str) -> Optional[str]:
    """sha256 of a small file; None when it is missing, unreadable or not small."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(_SMALL + 1)
    except OSError:
        return None
    if len(data) > _SMALL:
        return None
    return str(_sha256(data).hexdigest())


def _normalize(name: str) -> str:
    # PEP 503 normalisation, as importlib.metadata applies it to names and folders.
    out = name.lower()
    for ch in "-.":
        out = out.replace(ch, "_")
    while "__" in out:
        out = out.replace("__", "_")
    return out


def _header_version(path: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if not line.strip():
                    break  # the end of the RFC 822 header
                if line.startswith("Version:"):
                    return line[len("Version:") :].strip()
    except OSError:
        return None
    return None


def dist_version(name: str) -> Optional[str]:
    """The installed version of distribution `name`, as importlib.metadata.version reports
    it, without importing the package. Importing importlib.metadata itself costs ~20 ms
    (email, zipfile, csv...), a quarter of the fast path's budget, so the common layout —
    `<name>-<ver>.dist-info` folders in the sys.path entries, first entry wins — is read
    directly; anything else (zips, custom finders) goes to importlib.metadata."""
    want = _normalize(name)
    for entry in sys.path:
        try:
            children = os.listdir(entry or ".")
        except OSError:
            continue
        eggs: list[str] = []
        for child in children:
            low = child.lower()
            if not low.endswith((".dist-info", ".egg-info")):
                continue
            if _normalize(low.rpartition(".")[0].partition("-")[0]) != want:
                continue
            if low.endswith(".egg-info"):
                eggs.append(child)
                continue
            version = _header_version(os.path.join(entry or ".", child, "METADATA"))
            if version:
                return version
        for child in eggs:  # importlib.metadata prefers .dist-info within one entry too
            path = os.path.join(entry or ".", child)
            if os.path.isdir(path):
                path = os.path.join(path, "PKG-INFO")
            version = _header_version(path)
            if version:
                return version
    import importlib.metadata  # rare layouts only

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def python_tag() -> str:
    # Same as buildcache.toolchain.python_tag (tested); repeated to keep the fast path light.
    impl = "cp" if sys.implementation.name == "cpython" else sys.implementation.name
    return f"{impl}{sys.version_info[0]}{sys.version_info[1]}{getattr(sys, 'abiflags', '')}"


def modules_root() -> str:
    """modcache.modules_cache_root(), absolute (tested equal). Repeated here because that
    module's imports (pathlib, errors -> findings -> dataclasses) cost more than the whole
    fast path."""
    env = os.environ.get("HF_MODULES_CACHE")
    if env:
        root = os.path.expanduser(env)
    elif os.environ.get("HF_HOME"):
        root = os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "modules")
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = os.path.expanduser(xdg) if xdg else os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "huggingface", "modules")
    return os.path.abspath(root)


def load_state(target: str) -> Optional[dict[str, Any]]:
    # state.load_state reads the same file, but state.py imports importlib.metadata and
    # the journal (shutil, tempfile...) at the top: too slow to import here.
    try:
        with open(os.path.join(target, STATE_DIRNAME, STATE_FILE), encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _same_arch(asked: str, recorded: Sequence[str]) -> bool:
    from qwen_kvprep.buildcache.arch import parse_arch_list
    from qwen_kvprep.errors import UsageError

    try:
        return tuple(parse_arch_list(asked, "--arch")) == tuple(recorded)
    except UsageError:
        return False  # the slow path reports it


def _source_mismatch(source: Optional[str], state: dict[str, Any]) -> Optional[str]:
    """--source vendored|hub asks for particular kernel sources (an image whose baked build
    was compiled from qwen-kvprep's own must not pick up others it cannot compile)."""
    recorded = state.get("files") or {}
    if source == "vendored":
        from qwen_kvprep.resources import kernels_dir

        for name in KERNEL_FILES:
            if recorded.get(name) != sha256_small(str(kernels_dir() / name)):
                return f"--source vendored: {name} is not qwen-kvprep's own"
    elif source == "hub":
        origin = (state.get("sources") or {}).get("origin")
        if origin != "hub":
            return f"--source hub: the kernel sources came from {origin}"
    return None


# What the fast path planted into a fresh modules cache (reported before the hand-over).
PLANTED_NOW: list[str] = []


def _modules_mismatch(state: dict[str, Any], target: str) -> Optional[str]:
    """Whether the modules cache this process resolves to holds the planted copies.

    A fresh container starts with an empty modules cache (or another HF_HOME) while
    everything else still matches. The copies are then planted here from the checkpoint's
    own files, whose hashes were just verified, into the folder transformers will use (the
    recorded folder, moved to this root; the naming depends only on the checkpoint folder
    and the transformers version, both checked): a few small file writes instead of
    importing torch and transformers to run fix. Anything unexpected leaves the work to
    the slow path.
    """
    modules = state.get("modules") or {}
    planted = modules.get("files") or {}
    for name in KERNEL_FILES:
        if name not in planted:
            return f"the state records no modules-cache copy of {name}"
    root = modules_root()
    recorded_root = os.path.abspath(str(modules.get("root")))
    rel = os.path.relpath(os.path.abspath(str(modules.get("folder"))), recorded_root)
    if rel.startswith(os.pardir) or os.path.isabs(rel):
        return f"the recorded modules folder {modules.get('folder')} is outside its root"
    folders = [os.path.join(root, rel)]
    hub = modules.get("hub_folder")
    if hub:
        hub_rel = os.path.relpath(os.path.abspath(str(hub)), recorded_root)
        if hub_rel.startswith(os.pardir):
            return f"the recorded modules folder {hub} is outside its root"
        folders.append(os.path.join(root, hub_rel))
    for folder in folders:
        for name, digest in planted.items():
            if sha256_small(os.path.join(folder, name)) == digest:
                continue
            source = os.path.join(target, name)
            if sha256_small(source) != digest:
                return f"{name} is missing or different in the modules cache {folder}"
            try:
                _copy_atomically(source, os.path.join(folder, name))
            except OSError as exc:
                return f"cannot plant {name} into the modules cache {folder}: {exc}"
            if sha256_small(os.path.join(folder, name)) != digest:
                return f"{name} did not arrive intact in the modules cache {folder}"
            PLANTED_NOW.append(os.path.join(folder, name))
    return None


def _copy_atomically(source: str, dest: str) -> None:
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    tmp = f"{dest}.{os.getpid()}.tmp"
    try:
        with open(source, "rb") as src, open(tmp, "wb") as out:
            out.write(src.read())
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def state_mismatch(request: Request) -> Optional[str]:
    """Why the recorded state does not hold any more (None: it all still matches).

    Each test is a stat or the hash of a small file; the first failing one is the reason.
    """
    from qwen_kvprep import __version__

    target = request.target
    if request.output:
        from qwen_kvprep.view import view_mismatch

        assert request.directory is not None
        reason = view_mismatch(request.directory, target)
        if reason:
            return reason
    state = load_state(target)
    if state is None:
        return f"no state recorded in {target} (fix has not completed there)"
    if state.get("state_version") != 1:
        return f"the recorded state has version {state.get('state_version')}, not 1"
    if state.get("tool_version") != __version__:
        return f"recorded by qwen-kvprep {state.get('tool_version')}, this is {__version__}"
    if os.path.abspath(str(state.get("checkpoint"))) != target:
        # the modules-cache folder transformers uses is named after the checkpoint folder
        return f"the state was recorded for {state.get('checkpoint')}, not {target}"

    files = state.get("files") or {}
    for rel in TRACKED_FILES:
        if rel not in files:
            return f"the state records no hash for {rel}"
    for rel, digest in files.items():
        if sha256_small(os.path.join(target, rel)) != digest:
            return f"{rel} changed since fix recorded it"

    packages = state.get("packages") or {}
    for name in PACKAGES:
        current = dist_version(name)
        if current != packages.get(name):
            return f"{name} is {current}, fix ran with {packages.get(name)}"

    build = state.get("build")
    if not build:
        return "no build is recorded"
    build_dir = str(build.get("dir"))
    if not os.path.isfile(os.path.join(build_dir, str(build.get("so")))):
        return f"the recorded build {build_dir} is gone"
    try:
        with open(os.path.join(build_dir, "manifest.json"), encoding="utf-8") as fh:
            manifest = json.load(fh)
    except (OSError, ValueError):
        return f"the build manifest in {build_dir} is missing or unreadable"
    inputs = manifest.get("inputs") or {}
    if inputs.get("python_tag") not in (None, python_tag()):
        return f"the build is for {inputs.get('python_tag')}, this Python is {python_tag()}"
    if request.arch and build.get("cuda") and not _same_arch(request.arch, build["arch_list"]):
        return f"--arch {request.arch} differs from the build's {build.get('arch_list')}"

    reason = _modules_mismatch(state, target)
    if reason:
        return reason

    reason = _source_mismatch(request.source, state)
    if reason:
        return reason

    if request.smoke:
        smoke = state.get("smoke")
        if not isinstance(smoke, dict) or smoke.get("ok") is not True:
            return "--smoke asked and no passing smoke test is recorded"
    return None


# ------------------------------------------------------------------ handing over to CMD


def say(request: Request, text: str) -> None:
    # stderr: stdout belongs to CMD (a server's logs, a test's output).
    if not request.quiet:
        sys.stderr.write(f"qwen-kvprep prestart: {text}\n")


def _dump_imports() -> None:
    path = os.environ.get(ENV_DEBUG_IMPORTS)
    if path:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write("\n".join(sorted(sys.modules)) + "\n")


def hand_over(command: Sequence[str]) -> NoReturn:
    """exec CMD (its pid, signals and exit code become the container's), or exit 0."""
    _dump_imports()
    sys.stdout.flush()
    sys.stderr.flush()
    if not command:
        raise SystemExit(0)
    try:
        os.execvp(command[0], list(command))
    except OSError as exc:
        sys.stderr.write(f"qwen-kvprep prestart: cannot run {command[0]!r}: {exc.strerror}\n")
        code = EXIT_NOT_FOUND if isinstance(exc, FileNotFoundError) else EXIT_NOT_EXECUTABLE
        raise SystemExit(code) from None


def fast(args: Sequence[str]) -> None:
    """The entry point's shortcut: exec CMD when the state holds; return otherwise (the
    caller then runs the full command, which parses properly and does the work)."""
    request = parse_fast(args)
    if request is None:
        return
    try:
        reason = state_mismatch(request)
    except Exception:  # anything odd: the slow path looks again and reports properly
        return
    if reason is None:
        if PLANTED_NOW:
            folders = sorted({os.path.dirname(p) for p in PLANTED_NOW})
            say(request, f"planted the kernel sources and loader into {', '.join(folders)}")
        say(request, f"{request.target} is ready (recorded state matches)")
        hand_over(request.command)


# ------------------------------------------------------------------ slow path


def _locked(request: Request, work: Callable[[], None]) -> None:
    """Run `work` holding the per-checkpoint lock, so that replicas starting together on
    one directory do the work once: the others wait, then find the state matching."""
    from filelock import FileLock, Timeout

    from qwen_kvprep.buildcache.lock import lock_timeout
    from qwen_kvprep.errors import LockTimeout

    # A file of our own, not buildcache.lock.directory_lock: fix takes that flock on the
    # directory inside, and a second flock on the same directory from this process (another
    # descriptor) would wait for ourselves.
    timeout = lock_timeout()
    folder = os.path.join(request.target, STATE_DIRNAME)
    try:
        os.makedirs(folder, exist_ok=True)
        lock = FileLock(os.path.join(folder, LOCK_FILE))
        lock.acquire(timeout=0)
    except Timeout:
        say(request, f"waiting for another qwen-kvprep preparing {request.target}")
        try:
            lock.acquire(timeout=timeout)
        except Timeout:
            raise LockTimeout(
                f"another process kept {lock.lock_file} for more than {timeout:.0f} s",
                fix=f"see which process holds it (`fuser {lock.lock_file}`), or raise "
                f"{ENV_LOCK_TIMEOUT}",
            ) from None
    except OSError:
        # A read-only directory: no lock, and fix itself reports why it cannot write.
        work()
        return
    try:
        work()
    finally:
        lock.release()


def prepare(request: Request) -> list[Any]:
    """Do what the state says is missing, by running fix (idempotent steps: what is
    already right costs a hash). Returns fix's findings; raises KvprepError on failure."""
    from pathlib import Path

    from qwen_kvprep.errors import KvprepError
    from qwen_kvprep.findings import failed
    from qwen_kvprep.steps.fix import FixOptions, run_fix

    assert request.directory is not None
    directory = Path(os.path.abspath(request.directory))
    options = FixOptions(
        smoke=request.smoke,
        source=request.source or "auto",
        cache_dir=Path(request.cache_dir) if request.cache_dir else None,
        arch=request.arch,
        output=Path(os.path.abspath(request.output)) if request.output else None,
    )
    if options.output is not None:
        from qwen_kvprep.view import check_output_dir

        # before the lock below creates OUT/.qwen-kvprep: refuse a foreign OUT untouched
        check_output_dir(directory, options.output)
    findings: list[Any] = []

    def work() -> None:
        # Another replica may have finished while we waited for the lock.
        if state_mismatch(request) is None:
            return
        result = run_fix(directory, options)
        findings.extend(result.findings)
        if failed(result.findings):
            bad = [f for f in result.findings if f.severity.value == "fail"]
            raise KvprepError(
                f"fix reported {len(bad)} failure(s) while preparing {request.target}",
                fix=bad[0].fix,
                findings=result.findings,
            )

    _locked(request, work)
    return findings


def run(request: Request) -> NoReturn:
    """The full command: fast path, else prepare, then hand over to CMD."""
    from qwen_kvprep.errors import KvprepError, UsageError

    reason = state_mismatch(request)
    if reason is None:
        if PLANTED_NOW:
            folders = sorted({os.path.dirname(p) for p in PLANTED_NOW})
            say(request, f"planted the kernel sources and loader into {', '.join(folders)}")
        say(request, f"{request.target} is ready (recorded state matches)")
        hand_over(request.command)
    say(request, f"preparing: {reason}")
    try:
        findings = prepare(request)
    except UsageError:
        raise  # a wrong invocation is never papered over by --allow-fallback
    except Exception as exc:
        # --allow-fallback is for availability: any failure, even one we did not foresee,
        # must not keep the server down (it runs without the kernel, and says so).
        if not request.allow_fallback:
            raise
        if isinstance(exc, KvprepError):
            from qwen_kvprep.cli import report_error

            report_error(exc, as_json=False)
        else:
            sys.stderr.write(f"qwen-kvprep prestart: unexpected error: {exc!r}\n")
        # not through say(): --quiet silences success, never this
        sys.stderr.write("qwen-kvprep prestart: WARNING: --allow-fallback: starting the "
                         "command without a working Int8 KV cache kernel\n")
        hand_over(request.command)
    if findings and not request.quiet:
        from qwen_kvprep.report import emit, render_human

        emit(render_human(findings), sys.stderr)
    after = state_mismatch(request)
    if after is not None:
        say(request, f"note: prepared, but the next start will check again ({after})")
    hand_over(request.command)
