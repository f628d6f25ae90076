"""Serving engines on a folder convert wrote: `smoke OUT --engine vllm|transformers`.

Parent side: runner.py (children, judging), compare.py (pure comparisons), tables.py (the
text), installs.py (what installing an engine beside us breaks). Child side:
reference_child.py (transformers) and vllm_child.py (vLLM's offline engine). Light
imports only here.
"""
