"""Imports every check module (registration happens at import)."""

# Each area's module is added here as it is written.
from qwen_kvprep.checks import caches, checkpoint, config, env, kernels, state  # noqa: F401
