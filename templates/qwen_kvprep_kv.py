# qwen-kvprep fast path: the Int8 KV cache of Qwen (v1) without a per-step copy.
# Planted by `qwen-kvprep fix` beside cpp_kernels.py; `qwen-kvprep revert DIR` removes it
# and the lines of modeling_qwen.py that import it.
"""The quantized-cache attention of Qwen (v1)'s modeling_qwen.py, made fast.

modeling_qwen.py, once patched by `qwen-kvprep fix`, ends with a few lines that call
`install(globals())`. `install` then replaces two methods of the module's classes:

- `QWenAttention.forward`, for the one case it speeds up: the quantized cache
  (`use_cache_quantization`) with qwen-kvprep's compiled extension loaded
  (`use_cache_kernel`, the extension reports the features below), in inference. Every
  other case (unquantized cache, Qwen's own kernels, the torch fallback, training,
  `output_attentions`, flash-attn) goes to the model's own forward, unchanged.
- `QWenLMHeadModel._reorder_cache`, so that beam search reorders the quantized
  `(codes, scale, zero)` triples too (the model's own version calls `index_select` on the
  triple and fails).

What changes in the fast forward, and what does not:

- The cache lives in preallocated buffers per layer that grow by whole blocks of
  `BLOCK` tokens; a step writes its new tokens in place instead of concatenating the whole
  cache six times. The keys are kept as `[b, heads, head_dim, tokens]`, the layout the QK
  kernel reads, so the per-step transposed copy of the key cache is gone; scales and zero
  points are kept in fp16, the dtype the kernels take, so their per-step casts are gone.
- A layer's step past the projections and the rotary embedding is one call into the
  extension (`attention_step`): the fused quantize-and-append of the new keys and values,
  then the model's attention with the kernels, its operations run from C++ rather than
  one by one from Python (at batch 1, the interpreter's cost per operation outweighs the
  kernels). The queries and keys are rotated in one call of the model's rotary function
  rather than two, and what is fixed between steps is not looked up again at every step
  (the per-step cost in Python is what decides batch-1 decoding speed on a CPU).
- What the model hands back as its cache keeps the model's own format: per layer
  `((key_codes, key_scale, key_zero), (value_codes, value_scale, value_zero))`, codes
  `[b, heads, tokens, head_dim]` uint8 (the key codes as a transposed view of the buffer),
  scales and zeros `[b, heads, tokens, 1]`, all views of the buffers. Scales and zeros are
  fp16 where the model's own code keeps them in its dtype: the values are those the model
  itself casts to fp16 before every kernel call.
- The numbers are the model's own: the same quantization (one scale and zero point per
  batch row and head over each chunk of new tokens, rounded as the model's dtype rounds),
  the same kernels, the same masking, scaling and softmax, in the same order.
- A buffer is written in place only by the one sequence that owns its end: a cache that
  someone else has extended since (two generations from one prompt cache, beam search's
  reordering) is first copied into fresh buffers. So no one's cache changes under them.
"""

import warnings

import torch

FEATURES = ("capacity-views", "quantize-append", "attention-step-2")
BLOCK = 128  # tokens: buffers grow in whole blocks (rows stay 16-byte aligned)
MARK = "_qwen_kvprep_fast"  # set on the classes install() patched
STEPS = "qwen_kvprep_fast_steps"  # attention steps a layer ran through the fast path
OFF = "qwen_kvprep_fast_off"  # set on a layer to run the model's own code (comparisons)
BUFFERS = "_qwen_kvprep_buffers"  # a layer's _Buffers
# What the forward reads of a layer at every step are plain attributes, set with setattr
# (nn.Module keeps them in the instance's __dict__). Read there: an attribute that is
# absent (OFF, STEPS, the tiny model's kernel_calls) would otherwise go through
# nn.Module.__getattr__ and an AttributeError, microseconds each at every step.
# One scale and zero point per token for a prompt, instead of the model's one per (row,
# head) over the whole prompt: far smaller errors where token norms vary, other numbers
# than the model's own. `qwen-kvprep fix --per-token-prefill` sets it.
PER_TOKEN_PREFILL = False


def supported(kernels):
    """True when `kernels` is an extension built from qwen-kvprep's sources that can
    quantize into, and read from, the buffers (Qwen's own kernels cannot)."""
    if kernels is None:
        return False
    known = _SUPPORTED.get(id(kernels))
    if known is not None and known[0] is kernels:
        return known[1]
    answer = _supported(kernels)
    _SUPPORTED[id(kernels)] = (kernels, answer)
    return answer


_SUPPORTED = {}  # id -> (kernels, answer): asked once per extension object, not per step


def _supported(kernels):
    features = getattr(kernels, "features", None)
    if features is None:
        return False
    try:
        have = set(features())
    except Exception:  # an extension that cannot answer is treated as one without them
        return False
    return all(f in have for f in FEATURES)


class _Buffers:
    """One attention layer's cache: codes, scales and zero points for keys and values,
    `capacity` tokens each, of which the first `length` belong to the latest sequence."""

    __slots__ = ("batch", "capacity", "k", "k_ptr", "ks", "kz", "length", "v", "v_ptr", "vs",
                 "vz")

    def __init__(self, batch, heads, dim, capacity, device):
        self.k = torch.empty((batch, heads, dim, capacity), dtype=torch.uint8, device=device)
        self.v = torch.empty((batch, heads, capacity, dim), dtype=torch.uint8, device=device)
        self.ks, self.kz, self.vs, self.vz = (
            torch.empty((batch, heads, capacity, 1), dtype=torch.float16, device=device)
            for _ in range(4)
        )
        self.length = 0
        # fixed for the buffers' life: read once here, not at every step
        self.batch, self.capacity = batch, capacity
        self.k_ptr, self.v_ptr = self.k.data_ptr(), self.v.data_ptr()

    def owns(self, past):
        """True when `past` is this layer's latest cache, so appending cannot change a
        cache anyone else holds.

        Judged by where its tensors start, not by `Tensor._base`, which inference_mode does
        not track: the buffers are alive (this object holds them), so no other tensor can
        start at their addresses.
        """
        (kq, _, _), (vq, _, _) = past
        return (
            kq.data_ptr() == self.k_ptr
            and vq.data_ptr() == self.v_ptr
            and kq.shape[2] == self.length
            and kq.shape[0] == self.batch
            and kq.stride(-1) == self.capacity
        )

    def copy_from(self, past, length):
        """Takes the first `length` tokens of a cache in the model's format (ours or the
        model's own), converting scales and zeros to fp16."""
        (kq, ks, kz), (vq, vs, vz) = past
        self.k[..., :length].copy_(kq.transpose(-1, -2))
        self.v[:, :, :length].copy_(vq)
        for dst, src in ((self.ks, ks), (self.kz, kz), (self.vs, vs), (self.vz, vz)):
            dst[:, :, :length].copy_(src)
        self.length = length


def _blocks(tokens):
    return (tokens + BLOCK - 1) // BLOCK * BLOCK


def _buffers_for(layer, state, layer_past, batch, new_tokens, device):
    """The layer's buffers, ready to take `new_tokens` after the past: the same buffers
    when the past is their latest content and fits, else fresh ones holding a copy.
    `state` is the layer's __dict__."""
    buffers = state.get(BUFFERS)
    if layer_past is None:
        # A new sequence: let go of the last one's buffers before taking new ones, so that
        # a server's successive requests never hold two caches at once (whoever still holds
        # the old cache's views keeps its memory alive, as before).
        state.pop(BUFFERS, None)
        buffers = None
        past_length = 0
    else:
        past_length = layer_past[0][0].shape[2]
        if (
            buffers is not None
            and past_length + new_tokens <= buffers.capacity
            and buffers.owns(layer_past)
        ):
            return buffers, past_length
    # room for the next block of decoding steps before the next copy
    fresh = _Buffers(batch, layer.num_heads, layer.head_dim,
                     _blocks(past_length + new_tokens + 1), device)
    if past_length:
        fresh.copy_from(layer_past, past_length)
    state[BUFFERS] = fresh
    return fresh, past_length


def _rotate(apply_rotary, rotary_pos_emb_list, query_key):
    """Rotary embedding exactly as the model applies it (one table for the batch, or one
    per row for dynamic NTK per row), to the queries and keys at once: the model rotates
    them in two calls of the same elementwise function with the same table, so one call
    over both gives the same numbers with half the operations."""
    cur_len = query_key.shape[1]
    if len(rotary_pos_emb_list) == 1:
        return apply_rotary(query_key, [_last(t, cur_len) for t in rotary_pos_emb_list[0]])
    rows = []
    for i, table in enumerate(rotary_pos_emb_list):
        rows.append(apply_rotary(query_key[i : i + 1], [_last(t, cur_len) for t in table]))
    return torch.cat(rows, dim=0)


def _last(table, tokens):
    """table[:, -tokens:, :, :], the model's slice of a rotary table, in one call."""
    return table.narrow(1, table.shape[1] - tokens, tokens)


def _fast_forward(layer, state, kernels, apply_rotary, hidden_states, rotary_pos_emb_list,
                  layer_past, attention_mask, head_mask, use_cache):
    batch, new_tokens = hidden_states.shape[0], hidden_states.shape[1]
    heads = layer.num_heads
    # The model splits the projection into thirds of split_size and views each as
    # [b, s, heads, head_dim]: the same as viewing it as 3 * heads heads (the view fails
    # where the model's would).
    mixed = layer.c_attn(hidden_states).view(batch, new_tokens, 3 * heads, layer.head_dim)
    query_key = mixed.narrow(2, 0, 2 * heads)
    if rotary_pos_emb_list is not None:
        query_key = _rotate(apply_rotary, rotary_pos_emb_list, query_key)

    buffers, past_length = _buffers_for(layer, state, layer_past, batch, new_tokens,
                                        hidden_states.device)
    total = past_length + new_tokens
    if total > layer.seq_length and layer.use_logn_attn:
        logn = layer.logn_tensor[:, total - new_tokens : total, :, :].type_as(query_key)
        query = query_key.narrow(2, 0, heads)
        query_key = torch.cat((query * logn.expand_as(query), query_key.narrow(2, heads, heads)),
                              dim=2)
    # The extension quantizes the new tokens into the buffers, then runs the model's _attn
    # with its kernels (the same operations in the same order), and returns the context and
    # the cache as views of the buffers, in the model's format.
    context, present = kernels.attention_step(
        query_key, mixed.narrow(2, 2 * heads, heads),
        buffers.k, buffers.ks, buffers.kz, buffers.v, buffers.vs, buffers.vz,
        past_length, attention_mask,
        new_tokens == total,  # the model masks causally only when nothing is cached
        layer.head_dim**0.5 if layer.scale_attn_weights else 0.0,
        bool(state.get("softmax_in_fp32", False)),
        head_mask,
        PER_TOKEN_PREFILL,
    )
    buffers.length = total
    state[STEPS] = state.get(STEPS, 0) + 1
    if "kernel_calls" in state:  # qwen-kvprep's tiny model counts its kernel calls
        state["kernel_calls"] += 2
    return layer.c_proj(context), present if use_cache else None


def _flash_loaded(namespace):
    return any(
        namespace.get(name) is not None for name in ("flash_attn_unpadded_func", "flash_attn_func")
    )


def _reorder(past, beam_idx):
    if isinstance(past, (tuple, list)):
        return tuple(_reorder(item, beam_idx) for item in past)
    return past.index_select(0, beam_idx.to(past.device))


def install(namespace):
    """Patches the classes of a modeling_qwen.py module (its globals()). Does nothing, with
    a warning, when the module lacks what the fast path relies on."""
    attention = namespace.get("QWenAttention")
    lm_head = namespace.get("QWenLMHeadModel")
    apply_rotary = namespace.get("apply_rotary_pos_emb")
    if attention is None or lm_head is None or apply_rotary is None:
        warnings.warn(
            "qwen-kvprep: this modeling_qwen.py lacks QWenAttention, QWenLMHeadModel or "
            "apply_rotary_pos_emb; the Int8 cache runs the model's own code",
            stacklevel=2,
        )
        return
    if getattr(attention, MARK, False):
        return
    model_forward = attention.forward

    def forward(
        self,
        hidden_states,
        rotary_pos_emb_list=None,
        layer_past=None,
        attention_mask=None,
        head_mask=None,
        encoder_hidden_states=None,
        encoder_attention_mask=None,
        output_attentions=False,
        use_cache=False,
    ):
        state = self.__dict__
        kernels = state.get("cache_kernels")
        if (
            state.get("use_cache_quantization")
            and state.get("use_cache_kernel")
            and not output_attentions
            and not self.training
            and not state.get(OFF)
            and not (state.get("use_flash_attn") and _flash_loaded(namespace))
            and supported(kernels)
        ):
            return _fast_forward(
                self, state, kernels, apply_rotary, hidden_states, rotary_pos_emb_list,
                layer_past, attention_mask, head_mask, use_cache,
            )
        return model_forward(
            self, hidden_states, rotary_pos_emb_list, layer_past, attention_mask, head_mask,
            encoder_hidden_states, encoder_attention_mask, output_attentions, use_cache,
        )

    forward.__doc__ = model_forward.__doc__
    attention.forward = forward
    lm_head._reorder_cache = staticmethod(_reorder)
    setattr(attention, MARK, True)
    setattr(lm_head, MARK, True)


__all__ = ["BLOCK", "FEATURES", "MARK", "OFF", "STEPS", "install", "supported"]
