"""First step of `fix`: refuse a checkpoint that cannot work, before changing anything.

Runs every `checkpoint.*` check and `config.parse` (config.json is strict UTF-8 JSON with
unique keys, an object, a Qwen config: doctor and fix judge it by the same rules)."""

from __future__ import annotations

from pathlib import Path

from qwen_kvprep.checks import load_all, run_one
from qwen_kvprep.checks.identity import identify
from qwen_kvprep.errors import CheckpointError, ConfigError
from qwen_kvprep.findings import Finding, Severity
from qwen_kvprep.probe.checkpoint import probe_checkpoint
from qwen_kvprep.probe.env import EnvFacts, package_info
from qwen_kvprep.probe.facts import Facts
from qwen_kvprep.steps.context import FixContext
from qwen_kvprep.steps.converted import refusal

_ALSO = ("config.parse",)
IDENTITY = "checkpoint.identity"
# What fix itself changes: its own step reports that (doctor's view of it, taken before the
# step, would advise running the very fix under way, or refuse what fix repairs: Qwen's code
# as shipped on this transformers, and transformers_stream_generator, which only that code
# needs).
_FIX_OWNS = ("checkpoint.fast_path", "checkpoint.compat")


def check(directory: Path) -> tuple[Facts, list[Finding]]:
    """(facts, findings that are not ok); raises CheckpointError/ConfigError on a failure."""
    # the running transformers release, for the checks that depend on it (how it spells
    # module names); the rest of the environment is doctor's and the later steps'
    running = package_info("transformers").version
    facts = Facts(
        checkpoint=probe_checkpoint(directory), env=EnvFacts(transformers_version=running)
    )
    assert facts.checkpoint is not None
    if identify(facts.checkpoint).converted:
        # native Qwen2 already: fix's flags and kernels would break its loading, and
        # converting it again has no Qwen (v1) weights to read
        raise refusal(directory)
    findings: list[Finding] = []
    for chk in load_all().values():
        if (chk.area == "checkpoint" or chk.id in _ALSO) and chk.id not in _FIX_OWNS:
            findings.extend(run_one(chk, facts))
    bad = [f for f in findings if f.severity is Severity.FAIL]
    shown = [f for f in findings if f.severity is not Severity.OK]
    if bad and bad[0].id == IDENTITY:
        # not a Qwen (v1) checkpoint: what it is, and nothing the other checks would advise
        raise CheckpointError(bad[0].message, fix=bad[0].fix, findings=[bad[0]])
    if bad:
        config_only = all(f.id.startswith("config.") for f in bad)
        error = ConfigError if config_only else CheckpointError
        message = (
            bad[0].message
            if config_only and len(bad) == 1
            else f"{directory} is not a usable Qwen (v1) checkpoint: {len(bad)} problem(s)"
        )
        raise error(message, fix=bad[0].fix, findings=shown)
    return facts, shown


def run(ctx: FixContext) -> None:
    facts, findings = check(ctx.directory)
    ctx.add(*findings)
    ctx.facts = facts
