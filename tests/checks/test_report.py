"""The doctor's Markdown report over made-up facts, and the redaction every output goes
through: no secret from the environment survives."""

from __future__ import annotations

import pytest

from qwen_kvprep.checks import run_checks
from qwen_kvprep.findings import Finding, Severity
from tests.checks.facts import ENV_AND_CACHE_CHECKS, caches, ckpt, env_facts, facts


def test_scrub() -> None:
    from qwen_kvprep.redact import scrub, scrub_finding

    env = {
        "HF_TOKEN": "hf_" + "a" * 34,
        "MY_API_KEY": "s3cr3t-value",
        "SHORT_KEY": "1",
        "PATH": "/usr/bin",
    }
    masked = scrub(
        "token hf_" + "a" * 34 + " in /data/s3cr3t-value/x and hf_" + "B" * 31 + " v1.2", env
    )
    assert "a" * 34 not in masked and "s3cr3t-value" not in masked and "B" * 31 not in masked
    assert "v1.2" in masked  # a 1-character "secret" is not masked everywhere
    f = Finding(
        "env.x",
        Severity.FAIL,
        "at /data/s3cr3t-value",
        "rm /data/s3cr3t-value",
        ("/data/s3cr3t-value",),
        {"p": ["/data/s3cr3t-value"]},
    )
    g = scrub_finding(f, env)
    assert "s3cr3t-value" not in repr(g)


def test_report_markdown_has_versions_and_no_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    from qwen_kvprep.render import report_markdown

    token = "hf_" + "Z" * 36
    monkeypatch.setenv("HF_TOKEN", token)
    env = env_facts(
        env_vars={"HF_HOME": f"/home/u/{token}/hf", "CUDA_HOME": "/usr/local/cuda-12.1"}
    )
    found = run_checks(facts(env, checkpoint=ckpt(), cache=caches()), ENV_AND_CACHE_CHECKS)
    md = report_markdown(facts(env, checkpoint=ckpt(), cache=caches()), found)
    assert token not in md
    assert "HF_TOKEN" in md  # named as set, value hidden
    for needle in (
        "2.1.2+cu121",
        "NVIDIA A100",
        "4.37.2",
        "12.1",
        "use_cache_quantization",
        "env.nvcc",
    ):
        assert needle in md, needle
