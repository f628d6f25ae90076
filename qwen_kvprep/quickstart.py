"""prestart's quick start: exec CMD when nothing changed since `fix`.

It runs on every container start. When the state `fix` recorded still matches the files,
the installed torch/transformers, the build and the modules cache, it must cost a few
milliseconds: this module imports only the standard library and the standard-library-only
base modules at the top (no pathlib, typing, click, torch, transformers or
huggingface_hub), and `qwen_kvprep.entry` calls `fast()` before click is even imported.
When the state does not hold, `steps.prestart` (the slow path) does the missing part.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sys

from qwen_kvprep import __version__
from qwen_kvprep.common import (
    ENV_CACHE,
    KERNEL_FILES,
    REGISTER_TRIES,
    SMALL_FILE_LIMIT,
    TRACKED_FILES,
    USERS_DIRNAME,
    modules_cache_root,
    python_tag,
    read_arch_list,
    sha256_small,
    user_record_name,
)

# redact compiles its patterns on first use: importing it costs ~0.1 ms
from qwen_kvprep.redact import scrub
from qwen_kvprep.state.reader import inside, read_state
from qwen_kvprep.untrusted import open_dir_under, read_record, read_regular

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing costs milliseconds at import; only mypy needs it
    from collections.abc import Mapping, Sequence
    from typing import NoReturn, Optional

# Every option has an environment variable, because entrypoints are configured that way.
ENV_DIR = "QWEN_KVPREP_DIR"
ENV_OUTPUT = "QWEN_KVPREP_OUTPUT"
ENV_SMOKE = "QWEN_KVPREP_SMOKE"
ENV_ALLOW_FALLBACK = "QWEN_KVPREP_ALLOW_FALLBACK"
ENV_ARCH = "QWEN_KVPREP_ARCH"
ENV_SOURCE = "QWEN_KVPREP_SOURCE"
ENV_QUIET = "QWEN_KVPREP_QUIET"
# Test/bench hook: where to write the names of the imported modules just before exec.
ENV_DEBUG_IMPORTS = "QWEN_KVPREP_DEBUG_IMPORTS"
# The prebuilt SOURCE (a folder, ORG/NAME[@REV] or a lock) the folder must be prepared from;
# it wins over the one fix recorded.
ENV_PREBUILT = "QWEN_KVPREP_PREBUILT"

PACKAGES = ("torch", "transformers")
SOURCES = ("auto", "vendored", "hub")  # steps.sources.SOURCES
# click's BoolParamType spellings, so an environment variable means the same on both paths.
_TRUE = ("1", "true", "t", "yes", "y", "on")
_FALSE = ("0", "false", "f", "no", "n", "off")
EXIT_NOT_FOUND = 127  # as a shell reports a command it cannot find
EXIT_NOT_EXECUTABLE = 126


class Request:
    """What one prestart call asks for, options and environment merged."""

    __slots__ = ("allow_fallback", "arch", "as_json", "cache_dir", "command", "directory",
                 "output", "quiet", "smoke", "source")

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
        as_json: bool = False,
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
        self.as_json = as_json

    @property
    def target(self) -> str:
        """The folder fix works on and the state lives in: OUT for a view, else DIR."""
        path = self.output if self.output else self.directory
        assert path is not None
        return os.path.abspath(path)


class Planting:
    """What checking the state planted into the modules cache during one start: the files
    written (reported before the hand-over), and the folders the checkpoint was registered
    in (once each, however many files went there)."""

    __slots__ = ("files", "registered")

    def __init__(self) -> None:
        self.files: list[str] = []
        self.registered: set[str] = set()

    def folders(self) -> list[str]:
        return sorted({os.path.dirname(p) for p in self.files})


# ------------------------------------------------------------------ argument parsing


def env_flag(name: str) -> Optional[bool]:
    """A boolean environment variable as click reads it; None when unset or unreadable."""
    raw = os.environ.get(name, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    return None


def _readable_arch(arch: Optional[str]) -> bool:
    if arch is None or not arch.strip():
        return True  # none asked: the build's own list stands
    try:
        read_arch_list(arch, "--arch")
    except ValueError:
        return False
    return True


def parse_fast(args: Sequence[str]) -> Optional[Request]:
    """Parse `prestart`'s arguments without click, or None for anything unusual (--help,
    an unknown option, a bad value...): click then parses them and reports the problem."""
    args = list(args)
    command: list[str] = []
    if "--" in args:
        cut = args.index("--")
        args, command = args[:cut], args[cut + 1 :]
        if not command:
            return None  # `--` and nothing after it: click reports the usage error
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
    as_json = False
    i = 0
    while i < len(args):
        arg = args[i]
        name, eq, value = arg.partition("=")
        if arg == "--json":
            as_json = True
        elif arg == "--debug":
            pass  # tracebacks: the quick start reports nothing it could show one for
        elif name in values:
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
    if any(values[k] is not None and not str(values[k]).strip()
           for k in ("-o", "--output", "--cache-dir")):
        return None  # `-o "$VIEW"` with VIEW unset: click refuses it (exit 2)
    if values["--source"] not in (None, *SOURCES):
        return None
    if not _readable_arch(values["--arch"]):
        return None  # a typo in --arch/QWEN_KVPREP_ARCH: click says what is wrong (exit 2)
    cache_dir = values["--cache-dir"]
    if cache_dir and os.path.exists(cache_dir) and not os.path.isdir(cache_dir):
        return None  # a file: click says so (exit 2), also for $QWEN_KVPREP_CACHE
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
        as_json=as_json,
    )


# ------------------------------------------------------------------ the recorded state

# state.reader.read_state has checked the state against its schema; the reads below narrow
# each part with isinstance all the same, which costs nothing and keeps this module's
# reading of the state independent of how the schema's types are spelt.


def _object(value: object) -> Mapping[str, object]:
    """A JSON object's members; an empty object for null (or anything else)."""
    return value if isinstance(value, dict) else {}


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
    (email, zipfile, csv...), a quarter of the quick start's budget, so the common layout —
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


def _same_arch(asked: str, recorded: object) -> bool:
    if not isinstance(recorded, list):
        return False  # a build without its arch list: fix records it again
    try:
        return read_arch_list(asked, "--arch") == tuple(recorded)
    except ValueError:
        return False  # the slow path reports it


def _source_mismatch(source: Optional[str], state: Mapping[str, object]) -> Optional[str]:
    """--source vendored|hub asks for particular kernel sources (an image whose baked build
    was compiled from qwen-kvprep's own must not pick up others it cannot compile)."""
    recorded = _object(state.get("files"))
    if source == "vendored":
        # only --source vendored needs it; pathlib costs every other start ~7 ms
        from qwen_kvprep.resources import kernels_dir

        for name in KERNEL_FILES:
            if recorded.get(name) != sha256_small(str(kernels_dir() / name)):
                return f"--source vendored: {name} is not qwen-kvprep's own"
    elif source == "hub":
        origin = _object(state.get("sources")).get("origin")
        if origin == "prebuilt":
            # a prebuilt variant is held to the policy by the sources it was built from
            # (fix --prebuilt --source hub chose it so); only this start pays the import
            from qwen_kvprep.catalogue import known_good

            official = known_good().files
            for name in KERNEL_FILES:
                if recorded.get(name) != official[name].sha256:
                    return f"--source hub: the prebuilt variant's {name} is not Qwen's official"
        elif origin != "hub":
            return f"--source hub: the kernel sources came from {origin}"
    return None


def _prebuilt_mismatch(wanted: Optional[str], state: Mapping[str, object]) -> Optional[str]:
    """$QWEN_KVPREP_PREBUILT names the source of the library this folder may load: a folder
    prepared from anything else (a compile, another source, another lock) is prepared again
    from it (the lock then decides which library is installed and loaded)."""
    if not wanted:
        return None
    sources = _object(state.get("sources"))
    if sources.get("origin") == "prebuilt" and sources.get("prebuilt") == wanted:
        return None
    had = sources.get("prebuilt") if sources.get("origin") == "prebuilt" else sources.get("origin")
    return f"{ENV_PREBUILT} names {wanted}; the folder was prepared from {had}"


def _modules_mismatch(
    state: Mapping[str, object], target: str, planting: Planting
) -> Optional[str]:
    """Whether the modules cache this process resolves to holds the planted copies.

    A fresh container starts with an empty modules cache (or another HF_HOME) while
    everything else still matches. The copies are then planted here from the checkpoint's
    own files, whose hashes were just verified, into the folder transformers will use (the
    recorded folder, moved to this root; the naming depends only on the checkpoint folder
    and the transformers version, both checked): a few small file writes instead of
    importing torch and transformers to run fix. Only inside this root, and never through
    a symlink (state/reader.py checked that the recorded folders lie inside the recorded root and
    that only the sources and the loader are planted). Anything unexpected leaves the work
    to the slow path. What is planted is recorded in `planting`.
    """
    modules = _object(state.get("modules"))
    planted = _object(modules.get("files"))
    for name in KERNEL_FILES:
        if name not in planted:
            return f"the state records no modules-cache copy of {name}"
    root = os.path.abspath(modules_cache_root()[0])
    recorded_root = str(modules.get("root"))
    rels = []
    also = modules.get("also")
    for recorded in [modules.get("folder"), modules.get("hub_folder"), *(
        also if isinstance(also, list) else []
    )]:
        if not recorded:
            continue
        rel = inside(recorded_root, str(recorded))
        if rel in (None, "."):
            return f"the recorded modules folder {recorded} is outside its root"
        rels.append(rel)
    for rel in rels:
        folder = os.path.join(root, rel)
        for name, digest in planted.items():
            if sha256_small(os.path.join(folder, name)) == digest:
                continue
            source = os.path.join(target, name)
            if sha256_small(source) != digest:
                return f"{name} is missing or different in the modules cache {folder}"
            try:
                _plant(source, root, rel, name, target, planting)
            except OSError as exc:
                return f"cannot plant {name} into the modules cache {folder}: {exc}"
            if sha256_small(os.path.join(folder, name)) != digest:
                return f"{name} did not arrive intact in the modules cache {folder}"
            planting.files.append(os.path.join(folder, name))
    return None


def _plant(source: str, root: str, rel: str, name: str, target: str, planting: Planting) -> None:
    """Copy `source` to root/rel/name atomically, reaching the folder without following a
    symlink below `root` (a link planted there cannot redirect the write elsewhere), and
    register `target` in the folder the first time this start plants there."""
    os.makedirs(root, exist_ok=True)
    data = read_regular(source, SMALL_FILE_LIMIT)
    fd = open_dir_under(root, rel.split("/"), create=True)
    try:
        # the temporary-name pattern fix's cleanup knows: .<name>.<8 chars>.tmp
        tmp = f".{name}.{os.getpid() % 10**8:08d}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
        out = os.open(tmp, flags, 0o644, dir_fd=fd)
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(out, view) :]
            finally:
                os.close(out)
            os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=fd)
            raise
        if rel not in planting.registered:
            _register(fd, target)
            planting.registered.add(rel)
    finally:
        os.close(fd)


def _register(fd: int, target: str) -> None:
    """Mark the folder as used by the checkpoint being started (journal.register_user),
    so that reverting another folder of the same name leaves these copies alone."""
    with contextlib.suppress(OSError):
        for _ in range(REGISTER_TRIES):
            try:
                _write_record(fd, target)
                return
            except FileNotFoundError:
                # another checkpoint's fix pruned the records folder while it was empty
                continue


def _write_record(fd: int, target: str) -> None:
    with contextlib.suppress(FileExistsError):
        os.mkdir(USERS_DIRNAME, 0o755, dir_fd=fd)
    ufd = os.open(
        USERS_DIRNAME,
        os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_DIRECTORY", 0),
        dir_fd=fd,
    )
    try:
        name = user_record_name(target)
        text = '{"path": ' + json.dumps(target) + "}\n"
        tmp = f".{name}.{os.getpid() % 10**8:08d}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
        out = os.open(tmp, flags, 0o644, dir_fd=ufd)
        try:
            os.write(out, text.encode("utf-8", "surrogateescape"))
        finally:
            os.close(out)
        os.replace(tmp, name, src_dir_fd=ufd, dst_dir_fd=ufd)
    finally:
        os.close(ufd)


def _same_folder_planted(state: Mapping[str, object], recorded: str, target: str) -> bool:
    """Whether `target` is another spelling of the recorded checkpoint (a symlink to it,
    or its real path) whose modules-cache folder fix planted into as well."""
    if os.path.realpath(recorded) != os.path.realpath(target):
        return False
    modules = _object(state.get("modules"))
    also = modules.get("also")
    folders = [modules.get("folder"), *(also if isinstance(also, list) else [])]
    name = os.path.basename(target)
    return any(isinstance(f, str) and os.path.basename(f) == name for f in folders)


def state_mismatch(request: Request, planting: Optional[Planting] = None) -> Optional[str]:
    """Why the recorded state does not hold any more (None: it all still matches).

    Each test is a stat or the hash of a small file; the first failing one is the reason.
    Copies missing from the modules cache are planted on the way (see _modules_mismatch),
    and recorded in `planting` when one is given.
    """
    if planting is None:
        planting = Planting()
    target = request.target
    if request.output:
        # only --output needs it; its dataclasses and tempfile cost every other start ~30 ms
        from qwen_kvprep.view import view_mismatch

        assert request.directory is not None
        reason = view_mismatch(request.directory, target)
        if reason:
            return reason
    state, problem = read_state(target)
    if problem is not None:
        return f"the recorded state cannot be used: {problem}"
    if state is None:
        return f"no state recorded in {target} (fix has not completed there)"
    if state.get("tool_version") != __version__:
        return f"recorded by qwen-kvprep {state.get('tool_version')}, this is {__version__}"
    recorded = os.path.abspath(str(state.get("checkpoint")))
    if recorded != target and not _same_folder_planted(state, recorded, target):
        # the modules-cache folder transformers uses is named after the checkpoint folder
        return f"the state was recorded for {state.get('checkpoint')}, not {target}"

    files = _object(state.get("files"))
    for rel in TRACKED_FILES:
        if rel not in files:
            return f"the state records no hash for {rel}"
    for rel, digest in files.items():
        if sha256_small(os.path.join(target, rel)) != digest:
            return f"{rel} changed since fix recorded it"

    packages = _object(state.get("packages"))
    for name in PACKAGES:
        current = dist_version(name)
        if current != packages.get(name):
            return f"{name} is {current}, fix ran with {packages.get(name)}"

    build = _object(state.get("build"))
    if not build:
        return "no build is recorded"
    build_dir = str(build.get("dir"))
    so = os.path.join(build_dir, str(build.get("so")))
    if not os.path.isfile(so):
        return f"the recorded build {build_dir} is gone"
    if "so_size" in build and os.stat(so).st_size != build["so_size"]:
        return f"the recorded build's library {so} changed size since fix (damaged?)"
    try:
        manifest = read_record(os.path.join(build_dir, "manifest.json"))
    except (OSError, ValueError):
        return f"the build manifest in {build_dir} is missing or unreadable"
    if not isinstance(manifest, dict) or manifest.get("key") != build.get("key"):
        return f"the build manifest in {build_dir} is not that of build {build.get('key')}"
    if "so_sha256" in build and manifest.get("so_sha256") != build["so_sha256"]:
        # removed (`cache prune`) and compiled again since: another library, not yet smoked
        return f"the library in {build_dir} is not the one fix recorded (built again since)"
    inputs = manifest.get("inputs") or {}
    if not isinstance(inputs, dict):
        inputs = {}
    if inputs.get("python_tag") not in (None, python_tag()):
        return f"the build is for {inputs.get('python_tag')}, this Python is {python_tag()}"
    if request.arch and build.get("cuda") and not _same_arch(request.arch, build["arch_list"]):
        return f"--arch {request.arch} differs from the build's {build.get('arch_list')}"

    reason = _modules_mismatch(state, target, planting)
    if reason:
        return reason

    reason = _source_mismatch(request.source, state)
    if reason:
        return reason

    reason = _prebuilt_mismatch(os.environ.get(ENV_PREBUILT), state)
    if reason:
        return reason

    if request.smoke:
        smoke = state.get("smoke")
        if not isinstance(smoke, dict) or smoke.get("ok") is not True:
            return "--smoke asked and no passing smoke test is recorded"
    return None


# ------------------------------------------------------------------ handing over to CMD


def say(request: Request, text: str) -> None:
    # stderr: stdout belongs to CMD (a server's logs, a test's output). With --json the
    # document on stdout says it instead.
    if not request.quiet and not request.as_json:
        sys.stderr.write(f"qwen-kvprep prestart: {scrub(text)}\n")


def _dump_imports() -> None:
    path = os.environ.get(ENV_DEBUG_IMPORTS)
    if path:
        try:
            # O_NONBLOCK: a FIFO nobody reads is an error (ENXIO), not a start that hangs
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NONBLOCK", 0)
            fd = os.open(path, flags, 0o644)
            with open(fd, "w", encoding="utf-8") as fh:
                fh.write("\n".join(sorted(sys.modules)) + "\n")
        except OSError as exc:  # a debugging aid must not keep the server from starting
            sys.stderr.write(
                f"qwen-kvprep prestart: warning: cannot write {ENV_DEBUG_IMPORTS}={path}: "
                f"{exc.strerror or exc}\n"
            )


def hand_over(command: Sequence[str]) -> NoReturn:
    """exec CMD (its pid, signals and exit code become the container's), or exit 0.

    As a shell does: 127 when CMD cannot be found (or is empty), 126 when it is found but
    cannot be run (not executable, a folder, not a program), each with one line on stderr."""
    _dump_imports()
    sys.stdout.flush()
    sys.stderr.flush()
    if not command:
        raise SystemExit(0)
    name = command[0]
    if not name.strip() or "\x00" in name:
        _cannot_run(name, "command not found (empty name)" if not name.strip() else
                    "a command name cannot contain a NUL byte", EXIT_NOT_FOUND)
    try:
        os.execvp(name, list(command))
    except (OSError, ValueError) as exc:
        if isinstance(exc, (FileNotFoundError, NotADirectoryError, ValueError)):
            why, code = "command not found", EXIT_NOT_FOUND
        elif isinstance(exc, PermissionError) or exc.errno == errno.EISDIR:
            why, code = "permission denied (not an executable file)", EXIT_NOT_EXECUTABLE
        elif exc.errno == errno.ENOEXEC:
            why, code = "not a program this system can run (no #! line?)", EXIT_NOT_EXECUTABLE
        else:
            why, code = exc.strerror or str(exc), EXIT_NOT_EXECUTABLE
        _cannot_run(name, why, code)


def _cannot_run(name: str, why: str, code: int) -> NoReturn:
    sys.stderr.write(f"qwen-kvprep prestart: cannot run {name!r}: {why}\n")
    sys.stderr.flush()
    raise SystemExit(code)


def json_document(
    request: Request,
    planting: Planting,
    prepared: Optional[str] = None,
    findings: Sequence[Mapping[str, object]] = (),
    error: Optional[Mapping[str, object]] = None,
) -> str:
    """prestart's --json document, on one line: it is printed on stdout just before CMD
    takes stdout over, so a log reader finds it whole as the first line.

    `prepared` is why the slow path prepared the folder (None: the recorded state held);
    `error` is the failure --allow-fallback let through."""
    doc = {
        "schema_version": 1,
        "tool_version": __version__,
        "ok": error is None,
        "findings": list(findings),
        "prestart": {
            "directory": os.path.abspath(request.directory or ""),
            "target": request.target,
            "ready": error is None,
            "prepared": prepared,
            "planted": list(planting.files),
            "command": list(request.command),
            "fallback": error is not None,
        },
    }
    if error is not None:
        doc["error"] = dict(error)
    return scrub(json.dumps(doc, default=str))


def start_ready(request: Request, planting: Planting) -> NoReturn:
    """Say what this start did and that the folder is ready, then hand over to CMD."""
    if request.as_json:
        sys.stdout.write(json_document(request, planting) + "\n")
    if planting.files:
        # named file by file: what is planted depends on the checkpoint (the loader and the
        # kernel sources, and the fast path's module where fix installed it)
        names = sorted({os.path.basename(p) for p in planting.files})
        say(request, f"planted {', '.join(names)} into {', '.join(planting.folders())}")
    say(request, f"{request.target} is ready (recorded state matches)")
    hand_over(request.command)


def fast(args: Sequence[str]) -> None:
    """The entry point's shortcut: exec CMD when the state holds; return otherwise (the
    caller then runs the full command, which parses properly and does the work)."""
    request = parse_fast(args)
    if request is None:
        return
    planting = Planting()
    try:
        reason = state_mismatch(request, planting)
    except Exception:  # anything odd: the slow path looks again and reports properly
        return
    if reason is None:
        start_ready(request, planting)
