"""Probes gather facts and never change anything."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from qwen_kvprep.probe.converted import probe_converted  # standard library and records only
from qwen_kvprep.probe.facts import Facts


def gather(directory: Optional[Path], spelt: Optional[str] = None) -> Facts:
    """Probe the environment, the caches and (when given) the checkpoint; `spelt` is the
    checkpoint's path as the user wrote it."""
    # Imported here: checks/registry.py needs only probe/facts.py, and the probes (with
    # the build cache's and hub's modules) would add ~20 ms to every start of the CLI.
    from qwen_kvprep.probe.caches import probe_caches
    from qwen_kvprep.probe.checkpoint import probe_checkpoint
    from qwen_kvprep.probe.env import probe_env

    env = probe_env()
    checkpoint = probe_checkpoint(directory, spelt) if directory is not None else None
    caches = probe_caches(directory, env)
    converted = probe_converted(directory) if directory is not None else None
    return Facts(env=env, checkpoint=checkpoint, caches=caches, converted=converted)
