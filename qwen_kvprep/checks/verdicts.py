"""What a check says: `ok`/`info`/`warn`/`fail`/`skip`, its findings without an id.

They take findings.MakeFinding's arguments less the id (`fail(message, fix, paths,
details=..., **more)`): the registry stamps the check's own id on each finding it returns,
so an id is written once, in the check's declaration (checks/registry.py).
"""

from __future__ import annotations

from functools import partial

from qwen_kvprep import findings

# The id of a finding a check made, until the registry stamps the check's own on it.
UNSTAMPED = ""

ok = partial(findings.ok, UNSTAMPED)
info = partial(findings.info, UNSTAMPED)
warn = partial(findings.warn, UNSTAMPED)
fail = partial(findings.fail, UNSTAMPED)
skip = partial(findings.skip, UNSTAMPED)
