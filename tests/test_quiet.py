"""-q/--quiet on `fix` and `build`: only the result on stdout (what needs attention, then
the outcome), nothing on stderr; --json still prints the whole document."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.cli import invoke, kvprep


def test_fix_quiet_prints_the_verdict_alone(isolated_hf: Path, tmp_path: Path) -> None:
    from qwen_kvprep.tiny import generate_checkpoint

    ckpt = generate_checkpoint(tmp_path / "tiny")
    # a process of its own: transformers fixes its modules cache's place at its first import,
    # which in this process may have been another test's
    res = kvprep("fix", str(ckpt), "--no-build", "--no-smoke", "-q", env=dict(os.environ))
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["Result", "Next"], res.stdout
    assert "prepared but not proven" in lines[0]
    assert res.stderr == ""
    doc = json.loads(invoke("fix", str(ckpt), "--no-build", "--no-smoke", "-q", "--json").stdout)
    assert doc["findings"] and doc["verdict"] == "unproven"


def test_quiet_text_is_what_needs_attention_then_the_result() -> None:
    from qwen_kvprep.findings import fail, info, ok, warn
    from qwen_kvprep.render import render_quiet

    findings = [
        ok("config.kv_cache", "the flags are set"),
        warn("build.mode", "CPU-only build", fix="install nvcc"),
        info("build.note", "a note"),
        fail("smoke.run", "it crashed", fix="qwen-kvprep doctor /m"),
        ok("build.build", "found in the cache", paths=[Path("/c/builds/k")]),
    ]
    assert render_quiet(findings).splitlines() == [
        "warn: build.mode: CPU-only build", "  fix: install nvcc",
        "fail: smoke.run: it crashed", "  fix: qwen-kvprep doctor /m",
    ]
    last = render_quiet(findings, result=True).splitlines()[-1]
    assert last == "Result: found in the cache (/c/builds/k)"


def test_build_quiet_prints_the_build_and_where_it_is(isolated_hf: Path) -> None:
    res = invoke("build", "-q")
    assert res.returncode == 0, res.stdout + res.stderr
    *attention, line = res.stdout.splitlines()
    assert line.startswith("Result: ") and res.stderr == "", res.stdout + res.stderr
    # only what needs attention before it (a CUDA build of torch without a toolkit here:
    # the CPU-only build is a warning, with its fix)
    assert all(a.startswith(("warn: ", "fail: ", "  fix: ")) for a in attention), attention
    doc = json.loads(invoke("build", "--quiet", "--json").stdout)
    assert line == f"Result: found in the cache ({doc['build']['dir']})" or (
        line.startswith("Result: compiled in ") and line.endswith(f"({doc['build']['dir']})")
    ), line
