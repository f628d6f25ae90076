"""The registry of checks: every check is there, each skips without its facts, and a
check that crashes becomes its own failing finding instead of taking doctor down."""

from __future__ import annotations

import pytest

from qwen_kvprep.checks import REGISTRY, Check, run_checks
from qwen_kvprep.findings import Finding, Severity
from qwen_kvprep.probe.facts import Facts
from tests.checks.facts import ENV_AND_CACHE_CHECKS, facts, run


def test_all_checks_registered() -> None:
    for cid in ENV_AND_CACHE_CHECKS:
        assert cid in REGISTRY, cid


@pytest.mark.parametrize("cid", ENV_AND_CACHE_CHECKS)
def test_every_check_skips_without_its_facts(cid: str) -> None:
    found = run(cid, Facts())
    assert all(x.severity is Severity.SKIP for x in found), found


# ---------------------------------------------------------------------------------------
# a crashing check


def test_a_crashing_check_is_its_own_failing_finding(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(f: Facts) -> None:
        raise RuntimeError("deliberate")

    monkeypatch.setitem(REGISTRY, "env.zz_boom", Check("env.zz_boom", "boom", boom))
    found = run_checks(facts(), ["env.python", "env.zz_boom", "env.torch"])
    by_id = {f.id: f for f in found}
    assert by_id["env.zz_boom"].severity is Severity.FAIL
    assert "crashed: RuntimeError: deliberate" in by_id["env.zz_boom"].message
    assert (
        by_id["env.python"].severity is Severity.OK and by_id["env.torch"].severity is Severity.OK
    )


def test_checks_on_garbage_facts_crash_into_findings() -> None:
    # A fact of the wrong type must not take the whole doctor down.
    found = run_checks(Facts(env="not EnvFacts", caches=42), ENV_AND_CACHE_CHECKS)  # type: ignore[arg-type]
    assert {f.id for f in found} == set(ENV_AND_CACHE_CHECKS)


# ---------------------------------------------------------------------------------------
# ids are stamped by the registry


def test_the_registry_stamps_the_check_id(monkeypatch: pytest.MonkeyPatch) -> None:
    from qwen_kvprep.checks import verdicts
    from qwen_kvprep.findings import ok as ok_with_id

    def two(f: Facts) -> list[Finding]:
        return [verdicts.ok("fine"), verdicts.warn("careful", "do this", details={"n": 1})]

    monkeypatch.setitem(REGISTRY, "env.zz_two", Check("env.zz_two", "two", two))
    found = run_checks(facts(), ["env.zz_two"])
    assert [(f.id, f.severity, f.message) for f in found] == [
        ("env.zz_two", Severity.OK, "fine"),
        ("env.zz_two", Severity.WARN, "careful"),
    ]
    assert found[1].fix == "do this" and found[1].details == {"n": 1}

    def other(f: Facts) -> Finding:
        return ok_with_id("env.python", "a finding of another check")

    monkeypatch.setitem(REGISTRY, "env.zz_other", Check("env.zz_other", "other", other))
    (crash,) = run_checks(facts(), ["env.zz_other"])
    assert crash.id == "env.zz_other" and crash.severity is Severity.FAIL
    assert "returned a finding of env.python" in crash.message
