"""Imports every check module (registration happens at import)."""

# Each area's module is added here as it is written.
from qwen_kvprep.checks import checkpoint, config, kernels  # noqa: F401
from qwen_kvprep.checks import caches, env  # noqa: F401
