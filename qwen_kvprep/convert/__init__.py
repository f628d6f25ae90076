"""`qwen-kvprep convert DIR OUT`: a Qwen (v1) checkpoint written as native Qwen2, proven equal.

Modules, one job each:

- `pieces`: the plan's vocabulary (a tensor's header facts, one output tensor's source);
- `mapping`: Qwen v1 tensor names to Qwen2's (c_attn split into q, k, v), the plan checked
  against the config before anything is written (pure);
- `gptq`: how GPTQ's packed tensors split along the output (qweight and scales by columns,
  qzeros by packed columns, g_idx shared);
- `weights`: streamed reading of DIR's weight files and tensor-by-tensor writing of the
  output shards and their index;
- `readback`: each output shard read back as it is written, compared byte for byte with
  what was meant to be there, hashed and fsynced on a thread of its own;
- `source`: DIR's config, weight files and headers, read into the plan;
- `qwen2config`: config.json for Qwen2ForCausalLM, the context option and the GPTQ config;
- `output`: OUT's rules, the staging folder beside it, its lock and the final rename;
- `compare`: the streamed bit-for-bit proof that every OUT tensor equals its source slice;
- `run`: the orchestration, `convert(directory, out, options) -> ConvertResult` (it writes
  provenance.json through `qwen_kvprep.provenance`, the record's format, which doctor reads);
- `tokenizer`, `chat`: the tokenizer files, chat template and generation config;
- `verify`, `verify_child`, `context`: the proof by loading both models in a child process;
- `serving`: the command lines that serve OUT with the engines.
"""
