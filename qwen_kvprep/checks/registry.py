"""Where every check is declared: `@check(id, title, needs=...)`.

A check is a pure function from `Facts` to a Finding, several Findings or None (nothing to
say). It makes its findings with checks/verdicts.py's `ok`/`info`/`warn`/`fail`/`skip`,
which take no id: the registry stamps the check's id on every one, so an id is written
once, in the declaration. The id is dotted and starts with its area; the title is what
`doctor --list-checks` shows. `needs` names, in order, the parts of the facts it reads:
when one is missing the check is not called and the registry reports it as `skip`, with
that part's reason. A check that raises is reported as its own failing finding, so one
broken check never hides the others.
"""

from __future__ import annotations

import functools
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable

from qwen_kvprep import findings
from qwen_kvprep.checks.identity import identify
from qwen_kvprep.checks.verdicts import UNSTAMPED
from qwen_kvprep.configjson import CONFIG
from qwen_kvprep.findings import Finding, FindingsLike, as_list
from qwen_kvprep.probe.facts import Facts

if TYPE_CHECKING:
    from qwen_kvprep.probe.caches import CacheFacts
    from qwen_kvprep.probe.checkpoint import CheckpointFacts
    from qwen_kvprep.probe.converted import ConvertedFacts
    from qwen_kvprep.probe.env import EnvFacts

CheckFunc = Callable[[Facts], FindingsLike]

AREAS = (
    "env", "checkpoint", "convert", "config", "kernels", "build", "modules", "state", "smoke"
)


@dataclass(frozen=True)
class Need:
    """A part of the facts a check reads, and what its `skip` says when that is missing."""

    met: Callable[[Facts], bool]
    reason: str

    def saying(self, reason: str) -> Need:
        """The same need, its skip worded otherwise."""
        return Need(self.met, reason)


ENV = Need(lambda f: f.env is not None, "the environment was not probed")
TORCH = Need(
    lambda f: f.env is not None and f.env.torch_version is not None,
    "torch is not importable (see env.torch)",
)
CUDA_TORCH = Need(
    lambda f: f.env is not None and f.env.torch_cuda is not None,
    "not needed: torch is a CPU build, so the extension is built without CUDA",
)
CHECKPOINT = Need(lambda f: f.checkpoint is not None, "no checkpoint directory given")
# the same need, for the environment and cache checks that also look at a checkpoint
GIVEN_CHECKPOINT = CHECKPOINT.saying("no checkpoint given")
LISTED = Need(
    lambda f: f.checkpoint is not None and f.checkpoint.listing_error is None,
    "the checkpoint directory cannot be listed (see checkpoint.files)",
)
# a folder that is not a Qwen (v1) checkpoint gets one finding, checkpoint.identity's: the
# advice of the other checks (fetch Qwen's files, patch its config) would be wrong there
QWEN_V1 = Need(
    lambda f: f.checkpoint is not None
    and (f.checkpoint.listing_error is not None or identify(f.checkpoint).qwen_v1),
    "not a Qwen (v1) checkpoint (see checkpoint.identity)",
)
# config.parse also judges a config.json that does not parse in a folder without Qwen's
# files: what the folder is cannot be told until it does
CONFIG_JUDGED = Need(
    lambda f: f.checkpoint is not None
    and (f.checkpoint.listing_error is not None or identify(f.checkpoint).config_judged),
    "not a Qwen (v1) checkpoint (see checkpoint.identity)",
)
CONFIG_PARSED = Need(
    lambda f: f.checkpoint is not None and f.checkpoint.config is not None,
    f"{CONFIG} is missing or unreadable (see config.parse)",
)
CACHES = Need(lambda f: f.caches is not None, "the caches were not probed")
CONVERTED = Need(
    lambda f: f.converted is not None, "not a folder written by `qwen-kvprep convert`"
)


@dataclass(frozen=True)
class Check:
    id: str
    title: str
    func: CheckFunc
    needs: tuple[Need, ...] = ()

    @property
    def area(self) -> str:
        return self.id.split(".", 1)[0]

    def judge(self, facts: Facts) -> list[Finding]:
        """The check's findings, or its `skip` when a part of the facts it needs is missing;
        every one carries the check's id."""
        for need in self.needs:
            if not need.met(facts):
                return [findings.skip(self.id, need.reason)]
        return [self._stamp(f) for f in as_list(self.func(facts))]

    def _stamp(self, finding: Finding) -> Finding:
        if finding.id == UNSTAMPED:
            return replace(finding, id=self.id)
        if finding.id != self.id:
            raise ValueError(f"check {self.id} returned a finding of {finding.id}")
        return finding


REGISTRY: dict[str, Check] = {}


def check(id: str, title: str, needs: Sequence[Need] = ()) -> Callable[[CheckFunc], CheckFunc]:
    area = id.split(".", 1)[0]
    if area not in AREAS or "." not in id:
        raise ValueError(f"check id {id!r} must be dotted and start with one of {AREAS}")

    def register(func: CheckFunc) -> CheckFunc:
        if id in REGISTRY:
            raise ValueError(f"duplicate check id {id!r}")
        chk = REGISTRY[id] = Check(id, title, func, tuple(needs))

        # called directly, the function skips just as doctor reports it
        @functools.wraps(func)
        def judged(facts: Facts) -> FindingsLike:
            return chk.judge(facts)

        return judged

    return register


def run_one(chk: Check, facts: Facts) -> list[Finding]:
    try:
        return chk.judge(facts)
    except Exception as exc:  # a broken check must not hide the others
        tb = traceback.extract_tb(exc.__traceback__)
        where = f" at {tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno}" if tb else ""
        return [
            findings.fail(
                chk.id,
                f"the check itself crashed: {type(exc).__name__}: {exc}{where}",
                "report this as a qwen-kvprep bug, with `qwen-kvprep doctor --report`",
            )
        ]


# The parts of the facts a check declared in `needs`, typed.


def env_of(facts: Facts) -> EnvFacts:
    assert facts.env is not None, "declare needs=(ENV, ...)"
    return facts.env


def checkpoint_of(facts: Facts) -> CheckpointFacts:
    assert facts.checkpoint is not None, "declare needs=(CHECKPOINT, ...)"
    return facts.checkpoint


def converted_of(facts: Facts) -> ConvertedFacts:
    assert facts.converted is not None  # guaranteed by CONVERTED
    return facts.converted


def caches_of(facts: Facts) -> CacheFacts:
    assert facts.caches is not None, "declare needs=(CACHES, ...)"
    return facts.caches
