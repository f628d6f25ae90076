"""transformers_stream_generator is needed by nobody once a folder is fixed.

Qwen's chat_stream imports it; fix's compatibility lines take that import out of
transformers' check, and the compatibility module streams without it wherever it cannot be
imported. So fix and doctor judge the folder by what it needs once fixed, and "installed"
means importable: on transformers >= 4.57 the package is installed and yet fails to import.

Each test decides for itself whether the package imports, whatever this environment holds:
`absent` hides it (a meta-path finder that refuses it, in this process or in a child), and
`broken` puts in its place a package that fails the way the real one does on transformers 5.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import pytest

from qwen_kvprep.checks import load_all, run_one
from qwen_kvprep.findings import Finding, Severity
from qwen_kvprep.probe import env as probe_env
from qwen_kvprep.probe.checkpoint import probe_checkpoint
from qwen_kvprep.probe.env import EnvFacts, package_info
from qwen_kvprep.probe.facts import Facts
from qwen_kvprep.steps import validate
from qwen_kvprep.tiny import generate_checkpoint
from tests.cli import python
from tests.remote_code import with_compat

NAME = "transformers_stream_generator"
BROKEN = "cannot import name 'DisjunctiveConstraint' from 'transformers'"


class _Refuse:
    """A meta-path finder for which the package is not installed."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == NAME or name.startswith(NAME + "."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


def _forget(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget the package for this test: what it imports of it is forgotten afterwards too
    (a stand-in left in sys.modules would import for the tests after it)."""
    for name in [m for m in sys.modules if m == NAME or m.startswith(NAME + ".")]:
        monkeypatch.delitem(sys.modules, name)
    probe_env.import_error.cache_clear()


def _drop_stand_ins() -> None:
    for name in [m for m in sys.modules if m == NAME or m.startswith(NAME + ".")]:
        del sys.modules[name]
    probe_env.import_error.cache_clear()


@pytest.fixture()
def absent(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    _forget(monkeypatch)
    monkeypatch.setattr(sys, "meta_path", [_Refuse(), *sys.meta_path])
    yield
    _drop_stand_ins()


@pytest.fixture()
def broken(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """Installed (a distribution with a version), and its import fails."""
    _forget(monkeypatch)
    site = tmp_path / "site"
    (site / NAME).mkdir(parents=True)
    (site / NAME / "__init__.py").write_text(f"raise ImportError({BROKEN!r})\n")
    info = site / f"{NAME}-0.0.5.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: transformers-stream-generator\nVersion: 0.0.5\n"
    )
    monkeypatch.syspath_prepend(str(site))
    yield
    _drop_stand_ins()


@pytest.fixture()
def importable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """Installed, and imports (as on transformers < 4.57)."""
    _forget(monkeypatch)
    site = tmp_path / "site"
    (site / NAME).mkdir(parents=True)
    (site / NAME / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(site))
    yield
    _drop_stand_ins()


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_checkpoint(tmp_path_factory.mktemp("tpl") / "Qwen-tiny", shards=1)


@pytest.fixture()
def ckpt(template: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "Qwen-tiny"
    shutil.copytree(template, dest)
    return dest


def _findings(ckpt: Path, release: Optional[str], *ids: str) -> dict[str, Finding]:
    facts = Facts(
        checkpoint=probe_checkpoint(ckpt),
        env=None if release is None else EnvFacts(transformers_version=release),
    )
    checks = load_all()
    out: dict[str, Finding] = {}
    for id in ids:
        for finding in run_one(checks[id], facts):
            out[id] = finding
    return out


def _advice(finding: Finding) -> str:
    return f"{finding.message} {finding.fix or ''}"


# -- "installed" means importable -------------------------------------------------------------


def test_an_installed_package_that_cannot_import_is_not_found(broken: None) -> None:
    info = package_info(NAME)
    assert (info.found, info.version) == (False, "0.0.5")
    assert info.error is not None and "DisjunctiveConstraint" in info.error
    assert package_info("einops").found  # the others are still looked up without importing


def test_what_its_import_logs_is_dropped_too(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A handler made before the probe holds the real stderr (torch's does, and torchao
    logs through it when transformers imports it): nothing of the import reaches it."""
    import logging

    _forget(monkeypatch)
    site = tmp_path / "site"
    (site / NAME).mkdir(parents=True)
    (site / NAME / "__init__.py").write_text(
        "import logging\nlogging.getLogger('stand_in').warning('LOGGED AT IMPORT')\n"
        f"raise ImportError({BROKEN!r})\n"
    )
    monkeypatch.syspath_prepend(str(site))
    logger = logging.getLogger("stand_in")
    handler = logging.StreamHandler(sys.stderr)
    logger.addHandler(handler)
    try:
        capfd.readouterr()
        assert package_info(NAME).found is False
        out, err = capfd.readouterr()
        assert "LOGGED AT IMPORT" not in out + err, out + err
        logger.warning("LOGGED AFTER")  # logging is back as it was
        assert "LOGGED AFTER" in capfd.readouterr().err
    finally:
        logger.removeHandler(handler)
        _drop_stand_ins()


def test_env_summary_says_installed_but_not_importable(broken: None) -> None:
    summary = probe_env.summary(EnvFacts(packages={NAME: package_info(NAME)}))
    assert summary["packages"] == f"{NAME} 0.0.5 (installed, cannot be imported)"


# -- fix and prestart do not require it -------------------------------------------------------


@pytest.mark.parametrize("hide", ["absent", "broken"])
def test_fix_validation_does_not_require_it(
    ckpt: Path, hide: str, request: pytest.FixtureRequest
) -> None:
    request.getfixturevalue(hide)
    facts, findings = validate.check(ckpt)  # raises on a failing finding
    assert facts.checkpoint is not None
    assert NAME in facts.checkpoint.missing_requirements  # the code as shipped needs it
    assert facts.checkpoint.fixed_missing == ()
    assert not [f for f in findings if NAME in _advice(f)]


def test_fix_validation_judges_by_the_running_release(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[Optional[str]] = []
    real = validate.run_one

    def spy(chk: Any, facts: Facts) -> list[Finding]:
        seen.append(facts.env.transformers_version if facts.env is not None else None)
        return real(chk, facts)

    monkeypatch.setattr(validate, "run_one", spy)
    validate.check(ckpt)
    assert set(seen) == {package_info("transformers").version}


def test_a_missing_package_the_fixed_folder_needs_still_stops_fix(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = (ckpt / "modeling_qwen.py").read_text(encoding="utf-8")
    (ckpt / "modeling_qwen.py").write_text("import qwen_kvprep_no_such_package\n" + text)
    with pytest.raises(Exception) as caught:
        validate.check(ckpt)
    findings = caught.value.findings  # type: ignore[attr-defined]
    (bad,) = [f for f in findings if f.id == "checkpoint.requirements"]
    assert bad.fix == "pip install qwen_kvprep_no_such_package"


# -- doctor -----------------------------------------------------------------------------------


@pytest.mark.parametrize("hide", ["absent", "broken"])
def test_doctor_on_the_folder_as_shipped_advises_fix_not_the_package(
    ckpt: Path, hide: str, request: pytest.FixtureRequest
) -> None:
    request.getfixturevalue(hide)
    found = _findings(ckpt, "4.37.2", "checkpoint.requirements", "checkpoint.compat")
    assert found["checkpoint.requirements"].severity is Severity.OK
    compat = found["checkpoint.compat"]
    assert compat.severity is Severity.FAIL
    assert NAME in compat.message and "qwen-kvprep fix" in (compat.fix or "")
    assert "pip install" not in _advice(compat)


@pytest.mark.parametrize("hide", ["absent", "broken"])
def test_doctor_on_a_fixed_folder_does_not_mention_it(
    ckpt: Path, hide: str, request: pytest.FixtureRequest
) -> None:
    request.getfixturevalue(hide)
    with_compat(ckpt)
    for release in ("4.37.2", "5.24.0"):
        found = _findings(ckpt, release, "checkpoint.requirements", "checkpoint.compat")
        for finding in found.values():
            assert finding.severity is Severity.OK, finding
            assert NAME not in _advice(finding)


def test_doctor_without_a_checkpoint_does_not_ask_for_it(broken: None) -> None:
    env = EnvFacts(
        transformers_version="5.24.0",
        packages={m: package_info(m) for m in ("tiktoken", "einops", NAME)},
    )
    (finding,) = run_one(load_all()["env.remote_requirements"], Facts(env=env))
    assert finding.severity is Severity.OK
    assert NAME not in _advice(finding)


def test_doctor_names_the_running_release(ckpt: Path, importable: None) -> None:
    found = _findings(ckpt, "4.40.0", "checkpoint.compat")["checkpoint.compat"]
    assert found.severity is Severity.INFO
    assert "runs as shipped on transformers 4.40.0" in found.message


# -- a whole fix, in a process of its own without the package ---------------------------------

BLOCK = f"""
import sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name == {NAME!r} or name.startswith({NAME!r} + "."):
            raise ModuleNotFoundError("No module named " + repr(name), name=name)
sys.meta_path.insert(0, Refuse())
"""


@pytest.mark.slow
def test_fix_prepares_the_folder_and_chat_stream_streams_without_it(
    ckpt: Path, isolated_hf: Path, tmp_path: Path
) -> None:
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "hide"))
    (tmp_path / "hide").mkdir()
    # sitecustomize runs in every interpreter started with this PYTHONPATH: the smoke child too
    (tmp_path / "hide" / "sitecustomize.py").write_text(BLOCK)
    fix = subprocess.run(
        [sys.executable, "-m", "qwen_kvprep", "fix", str(ckpt), "--no-build", "--no-smoke",
         "--json"],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    doc = json.loads(fix.stdout)
    assert fix.returncode == 0, doc
    assert not [f for f in doc["findings"] if f["severity"] == "fail" or NAME in str(f["fix"])]
    script = BLOCK + f"""
import json, warnings
warnings.simplefilter("ignore")
from transformers import AutoModelForCausalLM, AutoTokenizer
try:
    import {NAME}
    raise SystemExit("the package was not hidden")
except ImportError:
    pass
folder = {str(ckpt)!r}
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
short = dict(max_new_tokens=4, do_sample=False)
parts = list(model.chat_stream(tok, "hello", history=None, **short))
response, _ = model.chat(tok, "hello", history=None, **short)
compat = sys.modules[type(model).__module__.rsplit(".", 1)[0] + ".qwen_kvprep_compat"]
print(json.dumps({{"parts": parts, "chat": response, "active": list(compat.ACTIVE)}}))
"""
    run = python(script, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert "stream" in out["active"]
    assert out["parts"] and out["parts"][-1] == out["chat"]
