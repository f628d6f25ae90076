"""Support for `qwen-kvprep plan`: reading a checkpoint's shape, capacity searches, sizes
and rendering. The prediction itself (the contract the `profile` side imports) is
qwen_kvprep/plan.py. Nothing here imports torch at import time."""
