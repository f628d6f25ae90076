"""`qwen-kvprep doctor` end to end, in subprocesses: the --json document against its
schema (on this machine and on a generated checkpoint), secrets kept out of every output,
exit codes, --strict, a torch that cannot be imported, a read-only file system, and a
stale torch JIT lock. doctor must change nothing in any of them."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Optional

import pytest

from tests import needs
from tests.advice import check_advice
from tests.checks.facts import ENV_AND_CACHE_CHECKS
from tests.cli import ENTRY, invoke, kvprep
from tests.treesnap import snapshot

REPO = Path(__file__).resolve().parent.parent
TOKEN = "hf_" + "QwenKvprepTestToken" + "x" * 17  # shaped like a real token (30+ chars)
API_KEY_VALUE = "kvprep-test-api-key-value"

# The --json document (schema_version 1), as a JSON Schema. Validated by the small
# validator below: the project does not depend on the jsonschema package.
FINDING_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["id", "severity", "message", "fix", "paths"],
    "additionalProperties": False,
    "properties": {
        "id": {
            "type": "string",
            "pattern": (
                r"^(env|checkpoint|convert|config|kernels|build|modules|state|smoke)"
                r"\.[a-z0-9_]+(\.[a-z0-9_]+)*$"
            ),
        },
        "severity": {"enum": ["ok", "info", "warn", "fail", "skip"]},
        "message": {"type": "string", "minLength": 1},
        "fix": {"type": ["string", "null"]},
        "paths": {"type": "array", "items": {"type": "string"}},
        "details": {"type": "object"},
    },
}
DOCUMENT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["schema_version", "tool_version", "ok", "findings"],
    "properties": {
        "schema_version": {"const": 1},
        "tool_version": {"type": "string", "minLength": 1},
        "ok": {"type": "boolean"},
        "findings": {"type": "array", "items": FINDING_SCHEMA},
    },
}
_TYPES = {
    "object": dict,
    "array": list,
    "string": str,
    "boolean": bool,
    "null": type(None),
}


def validate(value: Any, schema: dict[str, Any], where: str = "$") -> list[str]:
    """The subset of JSON Schema used above; returns every violation."""
    errors: list[str] = []
    if "const" in schema and value != schema["const"]:
        errors.append(f"{where}: {value!r} != {schema['const']!r}")
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{where}: {value!r} not in {schema['enum']}")
    if "type" in schema:
        names = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(isinstance(value, _TYPES[n]) for n in names):
            return [*errors, f"{where}: {type(value).__name__} is not {names}"]
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0):
            errors.append(f"{where}: shorter than {schema['minLength']}")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append(f"{where}: {value!r} does not match {schema['pattern']}")
    if isinstance(value, dict):
        for key in schema.get("required", []):
            if key not in value:
                errors.append(f"{where}: missing {key!r}")
        props = schema.get("properties", {})
        for key, sub in value.items():
            if key in props:
                errors += validate(sub, props[key], f"{where}.{key}")
            elif schema.get("additionalProperties") is False:
                errors.append(f"{where}: unexpected key {key!r}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            errors += validate(item, schema["items"], f"{where}[{i}]")
    return errors


def test_the_validator_rejects_a_bad_document() -> None:
    bad = {"schema_version": 2, "ok": "yes", "findings": [{"id": "nope", "severity": "bad"}]}
    errors = validate(bad, DOCUMENT_SCHEMA)
    assert any("tool_version" in e for e in errors)
    assert any("schema_version" in e for e in errors)
    assert any("severity" in e for e in errors)
    assert any("does not match" in e for e in errors)


# ---------------------------------------------------------------------------------------


def base_env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not re.search("TOKEN|KEY|SECRET|PASSWORD", k)}
    env.update(
        HF_HOME=str(tmp / "hf-home"),
        HF_MODULES_CACHE=str(tmp / "hf-home" / "modules"),
        QWEN_KVPREP_CACHE=str(tmp / "kvprep-cache"),
        PYTHONPATH=str(REPO),
        NO_COLOR="1",
    )
    env.update(extra)
    return env


def doctor(
    *args: str, env: dict[str, str], cwd: Path, entry: Sequence[str] = ENTRY
) -> subprocess.CompletedProcess[str]:
    return kvprep("doctor", *args, env=env, cwd=cwd, timeout=300, entry=entry)


def parse(res: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert "Traceback" not in res.stderr, res.stderr
    doc = json.loads(res.stdout)
    assert validate(doc, DOCUMENT_SCHEMA) == []
    fails = [f for f in doc["findings"] if f["severity"] == "fail"]
    assert doc["ok"] is (not fails)
    assert res.returncode == (1 if fails else 0), (res.returncode, fails)
    for f in doc["findings"]:
        if f["severity"] in ("warn", "fail"):
            assert f["fix"], f
    return doc


def by_id(doc: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for f in doc["findings"]:
        out.setdefault(f["id"], []).append(f)
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from qwen_kvprep.tiny import generate_checkpoint

    return generate_checkpoint(tmp_path_factory.mktemp("ckpt") / "Qwen-tiny")


ENV_IDS = set(ENV_AND_CACHE_CHECKS)


def test_json_on_this_machine(tmp_path: Path) -> None:
    doc = parse(doctor("--json", env=base_env(tmp_path), cwd=tmp_path))
    ids = by_id(doc)
    assert set(ids) >= ENV_IDS
    assert ids["modules.folder"][0]["severity"] == "skip"  # no checkpoint given
    assert ids["env.python"][0]["severity"] == "ok"
    assert not (tmp_path / "hf-home").exists() and not (tmp_path / "kvprep-cache").exists()


def test_json_on_a_generated_checkpoint_changes_nothing(tiny: Path, tmp_path: Path) -> None:
    env = base_env(tmp_path)
    (tmp_path / "hf-home" / "modules").mkdir(parents=True)
    before = snapshot(tiny), snapshot(tmp_path)
    doc = parse(doctor("--json", str(tiny), env=env, cwd=tmp_path))
    assert (snapshot(tiny), snapshot(tmp_path)) == before
    ids = by_id(doc)
    assert set(ids) >= ENV_IDS
    assert any(i.startswith("checkpoint.") for i in ids)
    # before the first load transformers has not created the module folder yet
    folder = ids["modules.folder"][0]
    assert folder["severity"] == "info"
    assert str(_modules_folder(env, tiny)) in folder["message"]  # the running transformers'


def test_secrets_never_printed(tiny: Path, tmp_path: Path) -> None:
    # The token also sits inside a path that findings quote, to prove scrubbing (not luck).
    home = tmp_path / f"home-{TOKEN}"
    env = base_env(
        tmp_path,
        HF_TOKEN=TOKEN,
        WANDB_API_KEY=API_KEY_VALUE,
        HF_HOME=str(home),
        HF_MODULES_CACHE=str(home / "modules"),
        QWEN_KVPREP_CACHE=str(tmp_path / API_KEY_VALUE / "cache"),
    )
    for args in (["--report"], ["--json"], [], ["--report", "--check", "modules.cache"]):
        res = doctor(*args, str(tiny), env=env, cwd=tmp_path)
        out = res.stdout + res.stderr
        assert "Traceback" not in out, out
        assert TOKEN not in out, args
        assert API_KEY_VALUE not in out, args
        assert "***" in out, args  # the paths were printed, masked
    report = doctor("--report", str(tiny), env=env, cwd=tmp_path).stdout
    assert "### qwen-kvprep report" in report
    assert "HF_TOKEN" in report and "WANDB_API_KEY" in report  # named as set, never valued
    assert "transformers" in report and "env.torch" in report


def test_usage_errors_and_selection(tmp_path: Path) -> None:
    env = base_env(tmp_path)
    bad = doctor("--check", "env.torch", "--check", "env.no_such_check", env=env, cwd=tmp_path)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "env.no_such_check" in bad.stderr
    listed = doctor("--list-checks", env=env, cwd=tmp_path)
    assert listed.returncode == 0
    assert {line.split()[0] for line in listed.stdout.splitlines() if line.strip()} >= ENV_IDS
    one = parse(
        doctor("--json", "--check", "env.python", "--check", "env.ninja", env=env, cwd=tmp_path)
    )
    assert set(by_id(one)) == {"env.python", "env.ninja"}


def test_strict_makes_warnings_fail(tiny: Path, tmp_path: Path) -> None:
    # fix planted the sources under another HF_HOME than this environment's: a warning
    copy = tmp_path / "Qwen-tiny"
    shutil.copytree(tiny, copy)
    state = {  # a complete state, as fix writes it (a partial one is a damaged state)
        "state_version": 1,
        "tool_version": "0.1.0",
        "checkpoint": str(copy),
        "files": {},
        "packages": {},
        "modules": {
            "root": "/build-time/hf/modules",
            "folder": "/build-time/hf/modules/transformers_modules/Qwen-tiny",
            "files": {},
        },
    }
    (copy / ".qwen-kvprep").mkdir()
    (copy / ".qwen-kvprep" / "state.json").write_text(json.dumps(state))
    env = base_env(tmp_path)
    lax = doctor("--check", "modules.folder", str(copy), env=env, cwd=tmp_path)
    assert lax.returncode == 0, lax.stdout + lax.stderr
    assert "WARN" in lax.stdout and "modules.folder" in lax.stdout
    strict = doctor("--strict", "--check", "modules.folder", str(copy), env=env, cwd=tmp_path)
    assert strict.returncode == 1
    # the Markdown report exits as the other outputs do
    report = doctor("--report", "--check", "modules.folder", str(copy), env=env, cwd=tmp_path)
    assert report.returncode == 0, report.stdout + report.stderr
    assert "| `modules.folder` | warn |" in report.stdout
    strict_report = doctor(
        "--report", "--check", "modules.folder", str(copy), "--strict", env=env, cwd=tmp_path
    )
    assert strict_report.returncode == 1
    assert strict_report.stdout == report.stdout


def test_stale_lock_reported_with_the_command_that_clears_it(tmp_path: Path) -> None:
    env = base_env(tmp_path)
    lock = (
        tmp_path / "hf-home" / "modules" / "transformers_modules" / "Qwen-tiny" / "build" / "lock"
    )
    lock.parent.mkdir(parents=True)
    lock.write_bytes(b"")
    doc = parse(doctor("--json", "--check", "modules.stale_lock", env=env, cwd=tmp_path))
    (finding,) = doc["findings"]
    if finding["severity"] == "warn":
        needs.skip("tool", "other processes' open files cannot be inspected here")
    assert finding["severity"] == "fail"
    assert finding["fix"] == f"rm -f {lock}"
    assert lock.exists()  # reported, never removed by doctor


def test_doctor_without_torch(tiny: Path, tmp_path: Path) -> None:
    shim = tmp_path / "shim" / "torch"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text('raise ImportError("torch is hidden by this test")\n')
    env = base_env(tmp_path, PYTHONPATH=f"{tmp_path / 'shim'}{os.pathsep}{REPO}")
    for args in (["--json"], ["--json", str(tiny)]):
        doc = parse(doctor(*args, env=env, cwd=tmp_path))
        ids = by_id(doc)
        torch_finding = ids["env.torch"][0]
        assert torch_finding["severity"] == "fail"
        assert "torch is hidden by this test" in torch_finding["message"]
        assert ids["env.transformers"][0]["severity"] in ("ok", "fail")
    human = doctor(str(tiny), env=env, cwd=tmp_path)
    assert human.returncode == 1 and "Traceback" not in human.stderr
    assert "env.torch" in human.stdout


def test_doctor_without_torch_and_transformers(tiny: Path, tmp_path: Path) -> None:
    # A bare interpreter (a venv with nothing installed) that sees only qwen-kvprep and the
    # small packages its CLI needs: torch, transformers and friends are really absent.
    import importlib.util

    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")],
        check=True,
        timeout=120,
    )
    site = tmp_path / "site"
    site.mkdir()
    for name in ("click", "packaging", "filelock"):
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.submodule_search_locations
        (site / name).symlink_to(next(iter(spec.submodule_search_locations)))
    env = base_env(tmp_path, PYTHONPATH=f"{site}{os.pathsep}{REPO}")
    bare = (str(tmp_path / "venv" / "bin" / "python"), "-m", "qwen_kvprep")
    res = doctor("--json", str(tiny), env=env, cwd=tmp_path, entry=bare)
    ids = by_id(parse(res))
    assert ids["env.torch"][0]["severity"] == "fail"
    assert ids["env.transformers"][0]["severity"] == "fail"
    assert 'transformers>=4.32"' in ids["env.transformers"][0]["fix"]
    assert ids["env.python"][0]["severity"] == "ok"
    report = doctor("--report", str(tiny), env=env, cwd=tmp_path, entry=bare)
    assert report.returncode == 1 and "Traceback" not in report.stderr
    assert "not importable" in report.stdout and "not installed" in report.stdout


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    try:
        res = subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return res.returncode == 0


def test_doctor_on_a_read_only_file_system(tiny: Path, tmp_path: Path) -> None:
    if not _unshare_works():
        needs.skip("root", "no user+mount namespaces for a read-only bind mount")
    root = tmp_path / "ro"
    copy = root / "Qwen-tiny"
    shutil.copytree(tiny, copy)
    (root / "hf-home" / "modules").mkdir(parents=True)
    env = base_env(
        tmp_path,
        HF_HOME=str(root / "hf-home"),
        HF_MODULES_CACHE=str(root / "hf-home" / "modules"),
        QWEN_KVPREP_CACHE=str(root / "kvprep-cache"),
        HOME=str(tmp_path / "home"),
    )
    before = snapshot(root)
    # A private mount namespace in which `root` is bind-mounted read-only onto itself.
    prefix = [
        "unshare",
        "-rm",
        "sh",
        "-c",
        'mount --bind -o ro "$1" "$1" && shift && exec "$@"',
        "sh",
        str(root),
    ]
    doc = parse(doctor("--json", str(copy), env=env, cwd=tmp_path, entry=(*prefix, *ENTRY)))
    assert snapshot(root) == before
    ids = by_id(doc)
    cache = ids["build.cache"][0]
    assert cache["severity"] == "fail"
    assert (
        "read-only file system" in cache["message"]
        and str(root / "kvprep-cache") in cache["message"]
    )
    assert "QWEN_KVPREP_CACHE" in cache["fix"] and "--cache-dir" in cache["fix"]
    assert ids["modules.cache"][0]["severity"] == "fail"
    assert ids["env.python"][0]["severity"] == "ok"
    # `fix DIR` would fail here: every fix command advised prepares a view elsewhere
    fixes = [f["fix"] for f in doc["findings"] if "qwen-kvprep fix" in (f.get("fix") or "")]
    assert fixes
    for text in fixes:
        for command in check_advice(text, models=[copy], read_only=[root]):
            if " fix " in command:
                assert f"-o {tmp_path / 'home' / 'qwen-kvprep-views' / 'Qwen-tiny'}" in command


# ---------------------------------------------------------------------------------------
# The exit code on folders fix prepared, row by row of the rule (docs/reference.md, doctor):
# 0 when a server started now runs the cache through the kernel or the cache is simply off,
# a toolchain problem a warning unless a build is needed, 1 for a fix cut short, 130 when
# doctor itself is interrupted.

# `qwen-kvprep ARGS`, cut short by Ctrl-C where fix is about to plant qwen_kvprep_kv.py in
# the modules cache: "before" its journal names the file, or "after" (intent recorded, the
# write not done).
CUT_SHORT = r"""
import sys
from pathlib import Path

from qwen_kvprep.journal import writer

when, modules, args = sys.argv[1], sys.argv[2], sys.argv[3:]


def cut(path):
    if Path(path).name == "qwen_kvprep_kv.py" and str(path).startswith(modules):
        raise KeyboardInterrupt


if when == "before":
    plant = writer.Journal.plant

    def plant_or_stop(self, path, *rest, **kw):
        cut(path)
        return plant(self, path, *rest, **kw)

    writer.Journal.plant = plant_or_stop
else:
    write = writer.atomic_write_bytes

    def write_or_stop(path, *rest, **kw):
        cut(path)
        return write(path, *rest, **kw)

    writer.atomic_write_bytes = write_or_stop

from qwen_kvprep.cli import main

main(args)
"""


def fix_env(tmp: Path, cache: Path, **extra: str) -> dict[str, str]:
    """doctor's environment, with the session's build cache and the CPU-only build."""
    from tests.toolkit import NO_TOOLKIT

    return base_env(tmp, QWEN_KVPREP_CACHE=str(cache), **{**NO_TOOLKIT, **extra})


def run_fix(ckpt: Path, env: dict[str, str], cwd: Path) -> None:
    done = kvprep("fix", str(ckpt), "--no-smoke", "--json", env=env, cwd=cwd, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.fixture(scope="module")
def fixed(
    tmp_path_factory: pytest.TempPathFactory, shared_build_cache: Path
) -> tuple[Path, dict[str, str]]:
    """A tiny checkpoint `fix` prepared (no smoke), and the environment it was prepared in."""
    from qwen_kvprep.tiny import generate_checkpoint

    tmp = tmp_path_factory.mktemp("fixed")
    ckpt = generate_checkpoint(tmp / "Qwen-tiny")
    env = fix_env(tmp, shared_build_cache)
    run_fix(ckpt, env, tmp)
    return ckpt, env


def _modules_folder(env: dict[str, str], ckpt: Path) -> Path:
    from tests.remote_code import code_folder

    return code_folder(Path(env["HF_MODULES_CACHE"]), ckpt)


@contextlib.contextmanager
def changed(path: Path, data: Optional[bytes]) -> Iterator[None]:
    """`path` holds `data` (None: it is removed) for the time of the block, then what it
    held before: the tests of one fixed folder change it one at a time."""
    before = path.read_bytes()
    if data is None:
        path.unlink()
    else:
        path.write_bytes(data)
    try:
        yield
    finally:
        path.write_bytes(before)


def _cache_off(ckpt: Path) -> bytes:
    """config.json with the Int8 cache turned off by hand (not the original's bytes: a file
    changed since fix wrote it is the user's)."""
    config = json.loads((ckpt / "config.json").read_bytes())
    config.update(use_cache_quantization=False, use_cache_kernel=False)
    data = (json.dumps(config, indent=3) + "\n").encode()
    originals = ckpt / ".qwen-kvprep" / "originals"
    assert data not in {p.read_bytes() for p in originals.iterdir()}
    return data


def test_a_prepared_folder_exits_0_judging_the_folder_transformers_runs_from(
    fixed: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    ckpt, env = fixed
    res = doctor("--json", str(ckpt), env=env, cwd=tmp_path)
    ids = by_id(parse(res))
    assert res.returncode == 0, [f for f in parse(res)["findings"] if f["severity"] == "fail"]
    # the folder a load by path runs the code from (transformers 5: <name>/<hash>/) first,
    # then those of other spellings of the path (4.x: `DIR/` runs it from the package)
    folder = _modules_folder(env, ckpt)
    assert ids["modules.folder"][0]["paths"] == [str(folder)]
    assert {f["severity"] for f in ids["modules.folder"]} == {"ok"}
    assert [f["severity"] for f in ids["modules.complete"]] == ["ok"]


def test_a_planted_file_removed_from_the_modules_cache_fails(
    fixed: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    ckpt, env = fixed
    planted = _modules_folder(env, ckpt) / "qwen_kvprep_kv.py"
    with changed(planted, None):
        res = doctor("--json", str(ckpt), env=env, cwd=tmp_path)
    assert res.returncode == 1
    (complete,) = by_id(parse(res))["modules.complete"]
    assert complete["severity"] == "fail" and complete["paths"] == [str(planted)]
    assert "fast path is not loaded" in complete["message"]
    assert f"qwen-kvprep fix {ckpt}" in complete["fix"]
    assert f"qwen-kvprep revert {ckpt}" in complete["fix"]


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_fix_cut_short_while_planting_fails_until_fix_finishes_it(
    when: str, tmp_path: Path, shared_build_cache: Path
) -> None:
    """A real fix, interrupted where it plants qwen_kvprep_kv.py: before its journal names
    the file (the folder holds the sources and the loader, so only the model code's import
    tells it is missing), or after (the journal names what never reached the disk)."""
    from qwen_kvprep.tiny import generate_checkpoint

    ckpt = generate_checkpoint(tmp_path / "Qwen-tiny")
    env = fix_env(tmp_path, shared_build_cache)
    script = tmp_path / "cut_short.py"
    script.write_text(CUT_SHORT)
    modules = env["HF_MODULES_CACHE"]
    cut = kvprep(
        "fix", str(ckpt), "--no-smoke",
        entry=(sys.executable, str(script), when, modules), env=env, cwd=tmp_path, timeout=900,
    )
    assert cut.returncode == 130, cut.stdout + cut.stderr
    planted = _modules_folder(env, ckpt) / "qwen_kvprep_kv.py"
    assert not planted.exists() and (planted.parent / "cpp_kernels.py").is_file()
    res = doctor("--json", str(ckpt), env=env, cwd=tmp_path)
    assert res.returncode == 1
    ids = by_id(parse(res))
    assert ids["modules.folder"][0]["severity"] == "ok"  # it holds the sources and loader
    (complete,) = ids["modules.complete"]
    assert complete["severity"] == "fail" and str(planted) in complete["paths"]
    assert all(p.endswith("/qwen_kvprep_kv.py") for p in complete["paths"])
    journal = json.loads((ckpt / ".qwen-kvprep" / "journal.json").read_text())
    named = any(rel.endswith("qwen_kvprep_kv.py") for g in journal["planted"] for rel in g["files"])
    assert named is (when == "after")
    run_fix(ckpt, env, tmp_path)  # what the finding advises
    parse(doctor("--json", str(ckpt), env=env, cwd=tmp_path))  # exits 0: no failure left


def test_the_journal_of_a_write_that_never_happened_fails(
    fixed: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    """The journal records a version before writing it: one that names a newer version of
    a planted source than the disk holds is a fix cut short between the two."""
    ckpt, env = fixed
    path = ckpt / ".qwen-kvprep" / "journal.json"
    journal = json.loads(path.read_bytes())
    source = _modules_folder(env, ckpt) / "cache_autogptq_cuda_256.cpp"
    rel = os.path.relpath(source, env["HF_MODULES_CACHE"])
    (entry,) = [g["files"][rel] for g in journal["planted"] if rel in g["files"]]
    entry["written"].append("0" * 64)
    with changed(path, json.dumps(journal).encode()):
        res = doctor("--json", str(ckpt), env=env, cwd=tmp_path)
    assert res.returncode == 1
    (complete,) = by_id(parse(res))["modules.complete"]
    assert complete["severity"] == "fail"
    assert "before fix wrote it" in complete["message"]
    assert "KV cache kernel source files" in complete["message"]


def _no_toolchain(tmp: Path) -> str:
    empty = tmp / "no-tools"
    empty.mkdir()
    return str(empty)  # PATH without c++ or ninja: env.host_compiler and env.ninja


@pytest.mark.parametrize("cached", [True, False])
def test_a_toolchain_problem_with_the_cache_off_is_a_warning(
    cached: bool, fixed: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    """The cache off (turned off by hand after fix, as before fix): a server started now
    builds nothing, whether or not a build is cached; doctor exits 0, and 1 with --strict."""
    ckpt, env = fixed
    env = dict(env, PATH=_no_toolchain(tmp_path))
    if not cached:
        env["QWEN_KVPREP_CACHE"] = str(tmp_path / "empty-cache")
    with changed(ckpt / "config.json", _cache_off(ckpt)):
        res = doctor("--json", str(ckpt), env=env, cwd=tmp_path)
        strict = doctor("--strict", str(ckpt), env=env, cwd=tmp_path)
    ids = by_id(parse(res))
    assert res.returncode == 0
    assert [f["severity"] for f in ids["config.kv_cache"]] == ["warn"]
    for tool in ("env.ninja", "env.host_compiler"):
        assert [f["severity"] for f in ids[tool]] == ["warn"], ids[tool]
    assert strict.returncode == 1


@pytest.mark.parametrize("cached", [True, False])
def test_a_toolchain_problem_fails_only_when_a_build_is_needed(
    cached: bool, fixed: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    """The cache on: a cached build for this torch serves the folder (a warning, exit 0),
    or none does, so the loader compiles at the first load (a failure, exit 1)."""
    ckpt, env = fixed
    env = dict(env, PATH=_no_toolchain(tmp_path))
    if not cached:
        env["QWEN_KVPREP_CACHE"] = str(tmp_path / "empty-cache")
    res = doctor("--json", str(ckpt), env=env, cwd=tmp_path)
    ids = by_id(parse(res))
    assert res.returncode == (0 if cached else 1)
    for tool in ("env.ninja", "env.host_compiler"):
        expected = "warn" if cached else "fail"
        assert [f["severity"] for f in ids[tool]] == [expected], ids[tool]


def test_an_interrupted_doctor_exits_130(monkeypatch: pytest.MonkeyPatch) -> None:
    from qwen_kvprep import doctor as engine

    def interrupted(*_args: object, **_kw: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(engine, "run_doctor", interrupted)
    res = invoke("doctor", "--json")
    assert res.returncode == 130
    assert "interrupted" in res.stderr and "Traceback" not in res.stderr


def test_transformers_own_warnings_stay_out_of_doctor(
    tmp_path: Path, isolated_hf: Path
) -> None:
    """doctor asks transformers' helpers how it names module folders; they warn as if a
    model were being imported ("The module name  (originally ) is not a valid Python
    identifier", for the empty name of the `DIR/` spelling). None of that reaches doctor's
    output, on an empty folder, another family's folder or one named like a keyword."""
    import logging

    heard: list[str] = []

    class Ear(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            heard.append(record.getMessage())

    import transformers  # noqa: F401  (it sets its loggers' level when first imported)

    lib = logging.getLogger("transformers")  # its loggers do not propagate to the root
    level = lib.level
    ear = Ear(logging.WARNING)
    lib.addHandler(ear)
    empty = tmp_path / "empty"
    empty.mkdir()
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "llama"}', encoding="utf-8")
    keyword = tmp_path / "class"
    keyword.mkdir()
    (keyword / "config.json").write_text('{"model_type": "llama"}', encoding="utf-8")
    try:
        for folder in (str(empty), str(other), f"{other}/", str(keyword)):
            res = invoke("doctor", folder)
            assert res.returncode == 1, res.stdout + res.stderr  # not a Qwen checkpoint
            assert "[transformers]" not in res.stderr, res.stderr
    finally:
        lib.removeHandler(ear)
    assert heard == []
    assert lib.level == level  # held back only while doctor asked
