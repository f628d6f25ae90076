"""Checks of what `fix` recorded in the checkpoint (`.qwen-kvprep/`): the state prestart
trusts on every start, and the journal `revert` restores from.

Both are data in a folder anyone with write access may have changed (or copied without
its originals): they are read with size and depth limits and checked against their
schema, and revert's own checks run here read-only, so a damaged record is a finding with
a fix, never a crash of doctor.
"""

from __future__ import annotations

import shlex

from qwen_kvprep.checks.registry import CACHES, CHECKPOINT, caches_of, check, checkpoint_of
from qwen_kvprep.checks.verdicts import fail, info, ok, skip, warn
from qwen_kvprep.findings import Finding, FindingsLike
from qwen_kvprep.probe.facts import Facts


def _folders(facts: Facts) -> tuple[str, str]:
    """The checkpoint as a shell word (for the commands the advice names), and where fix
    keeps its records of it (the state folder; the checkpoint itself while there is none)."""
    directory = checkpoint_of(facts).path
    return shlex.quote(str(directory)), caches_of(facts).state_dir or str(directory)


@check(
    "state.record",
    "The state fix recorded (for prestart) is readable and sound",
    needs=(CHECKPOINT, CACHES),
)
def record(facts: Facts) -> FindingsLike:
    here, records_dir = _folders(facts)
    caches = caches_of(facts)
    if caches.state_error is not None:
        again = f"qwen-kvprep fix {here}"
        return fail(
            f"{caches.state_error}: prestart cannot trust it, so every start prepares the "
            "folder again (importing torch), and doctor cannot tell what fix did",
            # fix refuses to write through a link there, so it cannot be the whole advice
            f"remove it (`{caches.state_foreign_removal}`) if you did not put it there, then "
            f"{again}"
            if caches.state_foreign_removal
            else f"{again}  (records the state anew; the journal keeps the originals for "
            "revert)",
            paths=[records_dir],
        )
    out: list[Finding] = []
    if caches.debris:
        shown = ", ".join(caches.debris[:3]) + (
            f" and {len(caches.debris) - 3} more" if len(caches.debris) > 3 else ""
        )
        out.append(
            warn(
                f"left behind by a fix, prestart or revert that was killed, or by a folder "
                f"removed without revert: {shown} (harmless, but not worth keeping)",
                f"qwen-kvprep fix {here} or qwen-kvprep revert "
                f"{here} removes them (the next one of either does)",
                paths=list(caches.debris),
            )
        )
    if caches.revert_undone and not caches.revert_problems:
        out.append(
            fail(
                f"{caches.state_dir} is left behind: every file fix changed is already back "
                "as it was before fix (a revert was cut short once it had restored them), but "
                "its records are still there, so prestart and doctor would trust a state "
                "that no longer holds",
                f"qwen-kvprep revert {here}  (finishes it; or "
                f"qwen-kvprep fix {here} to prepare the folder again)",
                paths=[records_dir],
            )
        )
        return out
    if caches.state is None and caches.journal_present and caches.journal_error is None:
        # the journal is written before each change and the state last: a fix that stopped
        # in between (a full disk, an error, a kill) leaves exactly this
        out.append(
            warn(
                f"fix changed files here ({caches.state_dir}/journal.json records them) but "
                "recorded no state: that fix did not finish (it failed, on a full disk for "
                "instance, or was stopped), so every start through prestart prepares the "
                "folder again",
                f"qwen-kvprep fix {here}  (finishes it; `qwen-kvprep revert {here}` undoes "
                "what it changed)",
                paths=[records_dir],
            )
        )
        return out
    if caches.state is None:
        return out or skip("fix has not recorded a state here")
    if not caches.journal_present and caches.journal_error is None:
        out.append(
            fail(
                f"{caches.state_dir}/state.json is left without the journal beside it: a "
                "revert was cut short (the files fix changed are already restored), so "
                "prestart and doctor would trust a state that no longer holds",
                f"qwen-kvprep revert {here}  (finishes it)",
                paths=[records_dir],
            )
        )
        return out
    return [ok("the recorded state is readable and sound"), *out]


@check(
    "state.journal",
    "The journal can restore every file fix changed (revert)",
    needs=(CHECKPOINT, CACHES),
)
def journal(facts: Facts) -> FindingsLike:
    caches = caches_of(facts)
    here, state_dir = _folders(facts)
    recover = (
        f"revert changes nothing while this is so; restore by hand what you need from "
        f"{shlex.quote(state_dir + '/originals')} (files named by their sha256, listed in "
        f"{shlex.quote(state_dir + '/journal.json')}), then remove {shlex.quote(state_dir)}"
    )
    if caches.journal_error is not None:
        return fail(caches.journal_error, recover, paths=[state_dir])
    if not caches.journal_present:
        return skip("fix has not changed this folder (no journal)")
    if caches.revert_problems:
        return [
            fail(f"`qwen-kvprep revert` would refuse: {p}", recover, paths=[state_dir])
            for p in caches.revert_problems
        ]
    out = [ok("the journal is sound: `qwen-kvprep revert` can restore what fix changed")]
    for note in caches.revert_notes:
        if "changed since fix wrote it" in note:
            out.append(
                warn(
                    f"{note}; a new fix takes it as the original",
                    f"qwen-kvprep fix {here}",
                    paths=[state_dir],
                )
            )
        elif "already as it was" not in note:
            out.append(info(f"revert would leave: {note}", paths=[state_dir]))
    return out
