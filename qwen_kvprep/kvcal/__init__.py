"""Calibrated fp8 KV caches: per-layer K and V scales measured on a converted folder, and
a reference that scores a passage through an fp8-quantized cache on any CPU.

- fp8.py: fp8 e4m3's range, the scale llm-compressor computes (absmax / 448), and the
  quantize-then-dequantize an engine's fp8 cache applies to what it stores;
- text.py: the calibration text (the convert proof's own corpus by default, or the user's
  file) and the passage the reference scores;
- calibrate.py: K (after rotary, as engines store it) and V, their absolute maximum per
  layer over the calibration text, measured block by block over OUT;
- scales.py: the scales written into OUT as vLLM and SGLang load them
  (compressed-tensors' kv_cache_scheme in config.json, k_scale/v_scale tensors);
- reference.py: a passage scored by transformers with its cache quantized to fp8, chunk by
  chunk, as top-k log-probabilities per position for kvjudge.
"""
