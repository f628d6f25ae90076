"""Predicted peak GPU memory of a Qwen (v1) generation run, with and without the Int8 cache.

This is the contract `qwen-kvprep profile` measures against (see the names below). A run:
the model loaded; B identical rows of P prompt tokens fed in chunks of C (one forward
each, with the past of the chunks before); then N greedy decode steps of one token per
row, one forward each; T = P + N tokens cached at the end. The peak is what
`torch.cuda.max_memory_allocated()` reports over the run, weights included.

The number is derived from what the remote code allocates (qwen_kvprep/tiny/remote/
modeling_qwen.py reproduces it), not fitted to published figures. A forward's peak is

    weights + cuBLAS workspace + rotary tables
    + the past it was given          (the caller still holds it while the forward runs)
    + the cache it returns           (torch.cat builds new tensors layer by layer, so at
                                      the end of the last layer old and new are both alive)
    + the previous forward's logits  (the caller holds its last output meanwhile)
    + the largest transient of one layer or of the head

and the run's peak is the largest forward peak. The transients of the last block are the
ones that count: there the new cache is (nearly) whole.

With the model split over several GPUs (planning/split.py, as transformers'
`device_map="auto"` splits it), each card's peak is the same sum over what that card
holds (a `Share`): its weights, its blocks' part of the past and of the new cache, the
transients of its last block, the head's on the card computing it, and the logits the
caller holds on the first card, where accelerate hands the outputs back.

Not counted here: the CUDA context and the kernels' code, which live outside the caching
allocator (`fits` accounts for them), allocator block rounding (512 bytes per tensor,
under a MiB for any Qwen model), and the caching allocator's fragmentation.

Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

MODES = ("unquantized", "int8")

# torch's default cuBLAS workspace (CUBLAS_WORKSPACE_CONFIG ":4096:2:16:8" before Hopper:
# two 4 MiB and eight 16 KiB chunks), taken from the caching allocator at the first matmul.
CUBLAS_WORKSPACE_BYTES = 2 * 4096 * 1024 + 8 * 16 * 1024

# Memory a CUDA process holds outside the caching allocator: the context and the loaded
# kernel images. PyTorch's out-of-memory messages on 80 GB A100/A800 cards put this
# "non-PyTorch memory" at about 0.5 GiB. Not part of the predicted peak (which is the
# allocator's), but the allocator cannot have it, so `fits` sets it aside.
CUDA_CONTEXT_BYTES = 512 * 1024**2


@dataclass(frozen=True)
class ModelShape:
    """What the prediction needs of a model (planning/model.py reads it from a checkpoint:
    `read_model(...).shape`, or `model_shape(DIR)`)."""

    layers: int  # num_hidden_layers
    heads: int  # num_attention_heads
    head_dim: int  # kv_channels (hidden_size // heads)
    hidden: int  # hidden_size
    intermediate: int  # config intermediate_size (Qwen's MLP width is intermediate // 2)
    vocab: int  # vocab_size (padded)
    dtype_bytes: int  # 2 for bf16/fp16, 4 for fp32
    weights_bytes: int  # bytes of all weight tensors as they sit on the GPU
    gptq_bits: Optional[int] = None  # GPTQ checkpoints: the bits of the packed weights


@dataclass(frozen=True)
class Share:
    """What one GPU holds of a model split over several (planning/split.py makes these):
    the bytes of its weights, how many decoder blocks (each block's cache lives with it),
    whether it is the first card (the embedding and the caller's tensors: accelerate
    moves the outputs back to the input's device, so the logits the caller keeps are
    there) and whether it computes the head (ln_f, lm_head and the logits of a forward)."""

    weights_bytes: int
    layers: int
    first: bool
    head: bool


def whole(shape: ModelShape) -> Share:
    """One GPU holding the whole model."""
    return Share(shape.weights_bytes, shape.layers, first=True, head=True)


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")


def kv_bytes_per_token(shape: ModelShape, mode: str, fast_path: bool = False) -> int:
    """Cache bytes of one token of one sequence, all layers, keys and values.

    Unquantized: 2·L·H·D·e. Int8: 2·L·H·(D + 2·s) -- a uint8 code per element plus a
    scale and a zero per token and head, s bytes each: the model's dtype (e) in the
    model's own code, fp16 (2) in qwen-kvprep's fast path, which keeps them as the kernels
    take them. The two differ only for fp32 models.
    """
    _check_mode(mode)
    scale_bytes = 2 if fast_path else shape.dtype_bytes
    per_head = (
        shape.head_dim * shape.dtype_bytes
        if mode == "unquantized"
        else (shape.head_dim + 2 * scale_bytes)
    )
    return 2 * shape.layers * shape.heads * per_head


# -- qwen-kvprep's fast path ----------------------------------------------------------------

# The fast path (templates/qwen_kvprep_kv.py, its BLOCK) keeps the Int8 cache of each layer
# in buffers of a whole number of blocks of this many tokens: a forward that starts a
# sequence, or whose tokens no longer fit, makes new buffers with room for the tokens plus
# one, rounded up to a block, copying the past while the caller still holds the old ones.
FAST_BLOCK = 128


def _blocks(tokens: int) -> int:
    return -(-tokens // FAST_BLOCK) * FAST_BLOCK


def _prefill_capacities(prompt: int, step: int) -> list[tuple[int, int, int]]:
    """(past, capacity before, capacity after) of each prefill forward of the fast path."""
    out, cap = [], 0
    for past in range(0, prompt, step):
        before = cap
        needed = past + min(step, prompt - past)
        if past == 0 or needed > cap:
            cap = _blocks(needed + 1)
        out.append((past, before, cap))
    return out


def _fast_capacity(prompt: int, step: int, fwd: _Forward) -> tuple[int, int]:
    """The fast path's buffer capacity in tokens before and after forward `fwd`."""
    prefill = _prefill_capacities(prompt, step)
    for past, before, after in prefill:
        if past == fwd.past:
            return before, after
    # decoding: one token a step; the buffers grow when the past fills them
    before = max(prefill[-1][2], _blocks(fwd.past))
    return before, (before if fwd.past + 1 <= before else _blocks(fwd.past + 2))


def _fast_growth_forwards(prompt: int, new: int, step: int) -> list[_Forward]:
    """The last forward of the prefill and of the decoding that grows the buffers: there
    the old and the new buffers are both alive, the largest such pair of each phase."""
    prefill = _prefill_capacities(prompt, step)
    picks = []
    grown = [past for past, before, after in prefill if past and after != before]
    if grown:
        picks.append(_Forward(grown[-1], min(step, prompt - grown[-1]), step))
    cap = prefill[-1][2]
    last = prompt + new - 1
    if new and last >= cap:
        past = cap + (last - cap) // FAST_BLOCK * FAST_BLOCK
        rest = prompt % step
        picks.append(_Forward(past, 1, 1 if past > prompt else rest or step))
    return picks


@dataclass(frozen=True)
class _Block:
    """What one block of a forward holds on either path, in bytes unless said."""

    e: int  # bytes per element of the model's dtype
    proj: int  # heads x head_dim
    tokens: int  # batch x tokens fed
    length: int  # tokens attended to: the past and those fed
    stream: int  # the embedding output, the residual stream and ln_1's or ln_2's output
    mixed: int  # c_attn's output [b, q, 3 x proj]
    mlp: int  # the MLP's peak


def _block(shape: ModelShape, batch: int, past: int, query: int) -> _Block:
    e = shape.dtype_bytes
    proj = shape.heads * shape.head_dim
    tokens = batch * query
    # QWenModel.forward keeps the embedding output (inputs_embeds) for the whole forward;
    # the block adds the residual stream and ln_1's or ln_2's output
    stream = tokens * 3 * shape.hidden * e
    return _Block(
        e=e,
        proj=proj,
        tokens=tokens,
        length=past + query,
        stream=stream,
        # c_attn's output stays alive for the whole attention forward (the value is a view
        # into it)
        mixed=tokens * 3 * proj * e,
        # the stream plus the attention output (the block still holds it), then w1(x),
        # silu(w2(x)) and their product, each [b, q, intermediate // 2]
        mlp=stream + tokens * (shape.hidden * e + 3 * (shape.intermediate // 2) * e),
    )


def _fast_transients(
    shape: ModelShape, batch: int, past: int, query: int, softmax_in_fp32: bool
) -> tuple[int, int]:
    """The fast path's largest transients inside the last block, as _layer_transients.

    Before its cache exists: the queries and keys rotated together (fp32 temporaries of
    [b, q, 2·proj]); the quantization writes into the buffers without temporaries. After:
    attention_step's tensors (an fp16 copy of the queries, the fp16 scores and, for long
    query blocks, the kernel's dequantized cache, the causal mask and the masked scores of
    a first forward, the softmax, the fp16 output and the context) and the MLP.
    """
    blk = _block(shape, batch, past, query)
    e, proj, tokens, length, stream, mixed = (
        blk.e, blk.proj, blk.tokens, blk.length, blk.stream, blk.mixed)
    before = stream + mixed + tokens * 2 * proj * 16
    attn_in = stream + mixed + tokens * 2 * proj * e
    scores = batch * shape.heads * query * length
    s2, se, s4 = 2 * scores, e * scores, 4 * scores
    mask = length * length if past == 0 else 0
    half_out = tokens * proj * 2
    # softmax: through an fp32 copy with softmax_in_fp32; then, unless the probabilities
    # go from fp16 to fp32 and back unchanged (fp32 models), a copy in the model's dtype
    # and one in fp16 for the kernel
    soft = s2 + 2 * s4 if softmax_in_fp32 else 2 * s2
    back = 0 if e == 4 and not softmax_in_fp32 else s2 + se + s2
    qk_ws, pv_ws = _kernel_workspaces(shape, batch, query, length)
    phases = (
        half_out + s2 + qk_ws,  # QK: the fp16 queries and the scores
        2 * s2 + mask,  # causal masking (a first forward only)
        soft,
        back,
        s2 + half_out + max(pv_ws, tokens * proj * e),  # PV's output, then the context
    )
    after = attn_in + max(phases)
    return before, max(after, blk.mlp)


# -- one forward ---------------------------------------------------------------------------


def _rotary_bytes(shape: ModelShape, length: int) -> int:
    # cos and sin tables, fp32 [1, n, 1, head_dim], rebuilt at n = 2 x the length when a
    # longer sequence arrives: at most 2 x the final length (all Qwen v1 rotate every channel)
    return 2 * max(2 * length, 16) * shape.head_dim * 4


# From these query lengths on, the CUDA kernels dequantize the whole K (resp. V) cache of
# the layer into an fp16 workspace and multiply with cuBLAS (the extension's defaults,
# kGemmMinQQk and kGemmMinQPv in kernels/cache_autogptq_cuda_kernel_256.cu).
KERNEL_GEMM_MIN_Q_QK = 256
KERNEL_GEMM_MIN_Q_PV = 128


def _kernel_workspaces(shape: ModelShape, batch: int, query: int, length: int) -> tuple[int, int]:
    """The fp16 dequantized cache [b, h, l, d] the QK and the PV kernel each hold during
    their call (0 below their query lengths)."""
    workspace = 2 * batch * shape.heads * length * shape.head_dim
    return (
        workspace if query >= KERNEL_GEMM_MIN_Q_QK else 0,
        workspace if query >= KERNEL_GEMM_MIN_Q_PV else 0,
    )


def _int8_scores(
    shape: ModelShape, batch: int, query: int, length: int, softmax_in_fp32: bool
) -> int:
    """Peak of QWenAttention._attn with the quantized cache on the kernel path.

    S is the score tensor [b, h, q, l]. In order: the QK kernel writes into a zeroed fp16 S
    and is handed fp16 copies of the query (`.to(fp16)` keeps the permuted strides, then
    `.contiguous()` copies again), of the key scales and zeros, and the key codes
    transposed by `.transpose(-1, -2).contiguous()`; S is cast to the model's dtype,
    divided by sqrt(d), masked (a bool causal mask and its negation), softmaxed (through
    fp32 with softmax_in_fp32) -- each step a new tensor while the old one is alive; the
    PV kernel gets an fp16 copy of the probabilities, fp16 value scales and zeros and a
    zeroed fp16 output. The casts to fp16 copy in bf16 and fp32 models and are no-ops in
    fp16 ones; ModelShape does not tell bf16 from fp16, so the copies are always counted
    (bf16 is what Qwen configs ask for; in fp16 this overstates by under one S in fp16).
    For long query blocks each kernel call also holds its fp16 dequantized cache
    [b, h, l, d]; the tensor-core P·V's split partials (a few MiB) are not counted.
    """
    e, h, d = shape.dtype_bytes, shape.heads, shape.head_dim
    scores = batch * h * query * length
    s2, se, s4 = 2 * scores, e * scores, 4 * scores
    scale_zero = 2 * batch * h * length * 2
    query_copies = 2 * batch * h * query * d * 2
    key_codes_t = batch * h * d * length
    out16 = batch * h * query * d * 2
    mask = 2 * query * length
    qk_ws, pv_ws = _kernel_workspaces(shape, batch, query, length)
    phases = (
        s2 + query_copies + key_codes_t + scale_zero + qk_ws,  # QK kernel
        s2 + se,  # .to(model dtype)
        2 * se + mask,  # / sqrt(d), masked_fill
        se + 2 * s4 if softmax_in_fp32 else 2 * se,  # softmax
        se + s2 + out16 + scale_zero + pv_ws,  # PV kernel
    )
    return max(phases)


def _sdpa_attention(shape: ModelShape, batch: int, query: int, length: int) -> int:
    """Peak of the unquantized attention: torch's scaled_dot_product_attention, fused on
    CUDA (torch >= 2.1) and on CPU, so no [b, h, q, l] score tensor exists.

    The remote code builds an additive mask [q, l]: a bool causal mask, its negation, a
    zero float mask and the masked copy (the zeros die after the fill); torch copies it
    once more to align its rows when l is not a multiple of 8 (counted always). Then the
    output [b, q, proj], its merged-heads copy and c_proj's output.
    """
    e = shape.dtype_bytes
    proj = shape.heads * shape.head_dim
    tokens = batch * query
    build = query * length * (2 + 2 * e)
    call = query * length * (1 + 2 * e) + tokens * proj * e
    merge = tokens * (2 * proj * e + shape.hidden * e)
    return max(build, call, merge)


def _layer_transients(
    shape: ModelShape, mode: str, batch: int, past: int, query: int, softmax_in_fp32: bool
) -> tuple[int, int]:
    """The largest transients inside the last block: (before its cache exists, after).

    Before: rotating the key and, for Int8, quantizing it -- the last layer's part of the
    new cache is not made yet. After: the attention itself and the MLP.
    """
    blk = _block(shape, batch, past, query)
    e, proj, tokens, length, mixed = blk.e, blk.proj, blk.tokens, blk.length, blk.mixed
    # the rotated query stays alive for the whole attention forward too
    attn_in = blk.stream + mixed + tokens * proj * e
    # rotating the key: four fp32 temporaries of [b, q, proj] (float copy, x·cos, the
    # rotated half, times sin) before their sum
    before = attn_in + tokens * proj * 16
    if mode == "int8":
        # quantize_cache_v on the rotated key: x / scale and + zero in the model's dtype,
        # then the uint8 codes made contiguous
        before = max(before, attn_in + tokens * proj * (3 * e + 1))
        after = attn_in + _int8_scores(shape, batch, query, length, softmax_in_fp32)
    else:
        # without a past the unquantized cache keeps c_attn's output: counted there
        if past == 0:
            attn_in -= mixed
        after = attn_in + _sdpa_attention(shape, batch, query, length)
    return before, max(after, blk.mlp)


def _returned_logits(shape: ModelShape, batch: int, query: int) -> int:
    """The logits of every position of the forward, [b, q, vocab] in the model's dtype
    (lm_head runs on all of them), and the caller's fp32 copy of the last position."""
    return batch * query * shape.vocab * shape.dtype_bytes + batch * shape.vocab * 4


def _head_transient(shape: ModelShape, batch: int, query: int) -> int:
    """ln_f's output and the logits with the caller's copy (_returned_logits)."""
    return batch * query * shape.hidden * shape.dtype_bytes + _returned_logits(
        shape, batch, query)


@dataclass(frozen=True)
class _Forward:
    past: int  # tokens already cached
    query: int  # tokens fed
    before: int  # tokens fed by the forward before (0 for the first)


def _fast_forward_peak(
    shape: ModelShape, batch: int, fwd: _Forward, prompt: int, step: int, softmax_in_fp32: bool,
    share: Share,
) -> int:
    """Peak of one forward of the Int8 cache through qwen-kvprep's fast path."""
    per_token = batch * kv_bytes_per_token(shape, "int8", fast_path=True)
    cap_before, cap_after = _fast_capacity(prompt, step, fwd)
    old_cache = per_token * cap_before if fwd.past else 0
    grows = fwd.past == 0 or cap_after != cap_before
    # appended in place: new buffers exist only when the forward grows them
    new_cache = per_token * cap_after if grows else 0
    old_logits = batch * fwd.before * shape.vocab * shape.dtype_bytes
    transients = _fast_transients(shape, batch, fwd.past, fwd.query, softmax_in_fp32)
    return _assembled(shape, batch, fwd, (old_cache, old_logits), new_cache, transients, share)


def _forward_peak(
    shape: ModelShape, mode: str, batch: int, fwd: _Forward, step: int, softmax_in_fp32: bool,
    share: Share,
) -> int:
    """Peak of one forward; `step` is the first forward's query length (the prefill chunk)."""
    per_token = batch * kv_bytes_per_token(shape, mode)
    unquantized = mode == "unquantized"
    # The past the caller hands in and holds until the forward returns. An unquantized
    # forward without a past does no torch.cat: its key is the rotated copy and its value
    # a view into c_attn's output, so it keeps 4·proj elements per token and layer, not 2;
    # the forward after it is handed that.
    old_cache = per_token * fwd.past * (2 if unquantized and fwd.past == step else 1)
    new_cache = per_token * (fwd.past + fwd.query) * (2 if unquantized and fwd.past == 0 else 1)
    # the caller's previous output, logits of every position it fed, is alive meanwhile
    old_logits = batch * fwd.before * shape.vocab * shape.dtype_bytes
    transients = _layer_transients(shape, mode, batch, fwd.past, fwd.query, softmax_in_fp32)
    return _assembled(shape, batch, fwd, (old_cache, old_logits), new_cache, transients, share)


def _assembled(
    shape: ModelShape, batch: int, fwd: _Forward, held: tuple[int, int], new_cache: int,
    transients: tuple[int, int], share: Share,
) -> int:
    """A forward's peak on the card holding `share`, from what the caller holds (its past,
    all layers', and its last logits), the cache the forward makes (all layers') and the
    last block's transients (before its cache exists, after). The card has its blocks'
    part of both caches; the transients of its last block, whose own cache is not made
    yet before; the head's where it computes the head; and on the first card the
    caller's logits, the old ones and, at the end, the new ones accelerate moves there."""
    if share.weights_bytes == 0 and share.layers == 0:
        return 0  # a card the split left empty
    old_cache, old_logits = held
    part = share.layers
    # every layer's cache is the same size, so a card's part is exact
    new = new_cache * part // shape.layers
    during = []
    if part:
        before, after = transients
        during += [new - new_cache // shape.layers + before, new + after]
    if share.head:
        during.append(new + _head_transient(shape, batch, fwd.query))
    elif share.first:
        during.append(new + _returned_logits(shape, batch, fwd.query))
    held_here = old_cache * part // shape.layers + (old_logits if share.first else 0)
    length = fwd.past + fwd.query
    fixed = share.weights_bytes + CUBLAS_WORKSPACE_BYTES + _rotary_bytes(shape, length)
    return fixed + held_here + max(during, default=new)


def _forwards(prompt: int, new: int, step: int) -> list[_Forward]:
    """The forwards whose peak can be the run's.

    A forward's peak grows with its past when its query and the query before it are fixed,
    so of the equal prefill chunks only the first, the second (handed the doubled past of
    _forward_peak) and the last can matter, then the shorter remainder; of the decode
    steps the first (which still holds the prefill's logits) and the last.
    """
    full, rest = divmod(prompt, step)
    picks = {_Forward(0, step, 0), _Forward(step * (full - 1), step, step if full > 1 else 0)}
    if full > 1:
        picks.add(_Forward(step, step, step))
    if rest:
        picks.add(_Forward(step * full, rest, step))
    if new:
        picks.add(_Forward(prompt, 1, rest or step))
        picks.add(_Forward(prompt + new - 1, 1, 1 if new > 1 else rest or step))
    return sorted(picks, key=lambda f: (f.past, f.query))


def predict_peak_bytes(
    shape: ModelShape,
    batch: int,
    prompt_tokens: int,
    new_tokens: int,
    mode: str,
    prefill_chunk: Optional[int] = None,
    *,
    softmax_in_fp32: bool = False,
    fast_path: bool = False,
    share: Optional[Share] = None,
) -> int:
    """Peak allocator bytes of the run described in the module docstring.

    `softmax_in_fp32` is config.json's flag of that name (default false, as QWenConfig's):
    it only changes the Int8 path's score temporaries. `fast_path`: the Int8 cache runs
    through qwen-kvprep's fast path (fix installs it), whose cache is whole blocks of
    FAST_BLOCK tokens appended in place, with fp16 scales and zero points. `share`: the
    peak of the one card that holds this part of a split model (default: one GPU holding
    the whole model).
    """
    _check_mode(mode)
    if batch < 1 or prompt_tokens < 1 or new_tokens < 0:
        raise ValueError("batch and prompt_tokens must be >= 1 and new_tokens >= 0")
    if prefill_chunk is not None and prefill_chunk < 1:
        raise ValueError("prefill_chunk must be >= 1 or None")
    step = prompt_tokens if prefill_chunk is None else min(prefill_chunk, prompt_tokens)
    card = whole(shape) if share is None else share
    if fast_path and mode == "int8":
        forwards = _forwards(prompt_tokens, new_tokens, step)
        forwards += _fast_growth_forwards(prompt_tokens, new_tokens, step)
        return max(
            _fast_forward_peak(shape, batch, fwd, prompt_tokens, step, softmax_in_fp32, card)
            for fwd in forwards
        )
    return max(
        _forward_peak(shape, mode, batch, fwd, step, softmax_in_fp32, card)
        for fwd in _forwards(prompt_tokens, new_tokens, step)
    )


def fits(peak_bytes: int, gpu_memory_bytes: int) -> bool:
    """Whether a run with this allocator peak fits a GPU of this total memory: the CUDA
    context takes its share outside the allocator first."""
    return peak_bytes + CUDA_CONTEXT_BYTES <= gpu_memory_bytes
