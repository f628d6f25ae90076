"""The fast path at work in a loaded model (fixed tiny checkpoint, CPU extension): the same
numbers as the model's own quantized-cache code, in every layer, through growth of the
buffers, beam search, streaming, padding, and two continuations of one cached prompt."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from qwen_kvprep.runtime import FAST_MARK, FAST_OFF, FAST_STEPS
from qwen_kvprep.tiny import generate_checkpoint
from tests.cli import kvprep

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory, shared_build_cache: Path) -> Iterator[Any]:
    from tests.toolkit import NO_TOOLKIT

    tmp = tmp_path_factory.mktemp("fastkv")
    ckpt = generate_checkpoint(tmp / "FastKV-Qwen", dtype="fp32", layers=2)
    env = dict(os.environ, HF_HOME=str(tmp / "hf"), HF_MODULES_CACHE=str(tmp / "hf" / "modules"),
               QWEN_KVPREP_CACHE=str(shared_build_cache), **NO_TOOLKIT)
    done = kvprep("fix", str(ckpt), "--no-smoke", "--json", env=env, timeout=1800)
    assert done.returncode == 0, done.stdout + done.stderr
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers import dynamic_module_utils as dmu

    # transformers read the modules cache's place at its import: point it at the one fix
    # planted into for this load only, and put everything back for the tests after
    saved = {k: os.environ.get(k) for k in ("HF_HOME", "HF_MODULES_CACHE", "QWEN_KVPREP_CACHE")}
    saved_root = dmu.HF_MODULES_CACHE
    os.environ.update({k: env[k] for k in saved})
    dmu.HF_MODULES_CACHE = env["HF_MODULES_CACHE"]
    _forget_remote_code()  # a model of this name loaded earlier in this process
    # transformers appends its modules cache to sys.path, after any an earlier load in this
    # process appended: first here, so that `transformers_modules` is this cache's package
    # (transformers 5.17 imports the model's relative imports through it)
    # and alone: a modules cache an earlier in-process load of this worker appended holds a
    # regular `transformers_modules` package, which the import system prefers to the one
    # here wherever this one is still only a folder (ModuleNotFoundError for this model)
    saved_path = list(sys.path)
    sys.path[:] = [env["HF_MODULES_CACHE"]] + [
        p for p in saved_path if not os.path.isdir(os.path.join(p, "transformers_modules"))
    ]
    importlib.invalidate_caches()
    try:
        m = AutoModelForCausalLM.from_pretrained(str(ckpt), trust_remote_code=True).eval()
        m.tokenizer = AutoTokenizer.from_pretrained(str(ckpt), trust_remote_code=True)
        yield m
    finally:
        sys.path[:] = saved_path
        dmu.HF_MODULES_CACHE = saved_root
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _forget_remote_code()


def _forget_remote_code() -> None:
    for name in [n for n in sys.modules if n.startswith("transformers_modules")]:
        del sys.modules[name]


def _layers(model: Any) -> list[Any]:
    return [block.attn for block in model.transformer.h]


def _fast(model: Any, on: bool) -> None:
    for layer in _layers(model):
        setattr(layer, FAST_OFF, not on)
        setattr(layer, FAST_STEPS, 0)


def _greedy(model: Any, prompt: Any, new: int, **kw: Any) -> Any:
    with torch.no_grad():
        return model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              top_p=None, top_k=None, **kw)


def _stepwise_logits(model: Any, tokens: Any, prompt_len: int) -> Any:
    """Prefill, then one token at a time through the cache (teacher forcing)."""
    with torch.no_grad():
        out = model(tokens[:, :prompt_len], use_cache=True)
        past, logits = out.past_key_values, [out.logits[:, -1]]
        for t in range(prompt_len, tokens.size(1)):
            out = model(tokens[:, t : t + 1], past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits.append(out.logits[:, -1])
    return torch.stack(logits, 1)


PROMPT = [[5, 17, 99, 3, 42, 7, 250, 11, 64, 300, 12]]


def test_installed_in_every_layer_with_our_extension(model: Any) -> None:
    layers = _layers(model)
    assert getattr(type(layers[0]), FAST_MARK, False)
    assert all(layer.cache_kernels is not None for layer in layers)
    assert "quantize-append" in set(layers[0].cache_kernels.features())


def test_same_numbers_as_the_model_s_own_code_across_buffer_growth(model: Any) -> None:
    prompt = torch.tensor(PROMPT)
    new = 150  # crosses the 128-token block: the buffers grow once, copying what they hold
    _fast(model, False)
    own = _greedy(model, prompt, new)
    own_logits = _stepwise_logits(model, own, prompt.size(1))
    assert all(getattr(layer, FAST_STEPS) == 0 for layer in _layers(model))
    _fast(model, True)
    fast = _greedy(model, prompt, new)
    assert all(getattr(layer, FAST_STEPS) == new for layer in _layers(model))  # prefill + new-1
    assert torch.equal(fast, own)
    fast_logits = _stepwise_logits(model, own, prompt.size(1))
    assert torch.equal(fast_logits, own_logits), (fast_logits - own_logits).abs().max()


def test_two_continuations_of_one_cached_prompt_do_not_touch_each_other(model: Any) -> None:
    """b continues the prompt's cache after a has grown it in place: b must not see a's
    token, and a's second step must not see b's."""
    prompt, a, b = torch.tensor(PROMPT), torch.tensor([[21]]), torch.tensor([[400]])
    runs = []
    for on in (True, False):
        _fast(model, on)
        with torch.no_grad():
            past = model(prompt, use_cache=True).past_key_values
            out_a1 = model(a, past_key_values=past, use_cache=True)
            out_b = model(b, past_key_values=past, use_cache=True)
            out_a2 = model(a, past_key_values=out_a1.past_key_values, use_cache=True)
        runs.append((out_a1.logits, out_b.logits, out_a2.logits))
    for fast, own in zip(*runs):
        assert torch.equal(fast, own)


def test_beam_search_over_the_quantized_cache(model: Any) -> None:
    prompt = torch.tensor(PROMPT)
    results = []
    for on in (True, False):  # the model's own _reorder_cache fails on the triples
        _fast(model, on)
        results.append(_greedy(model, prompt, 12, num_beams=3, num_return_sequences=2))
    assert results[0].shape == (2, prompt.size(1) + 12)
    assert torch.equal(results[0], results[1])


def test_a_padded_batch_matches_the_model_s_own_code(model: Any) -> None:
    ids = torch.tensor([[0, 0, 0, 5, 17, 99, 3], [8, 9, 10, 11, 12, 13, 14]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    out = []
    for on in (True, False):
        _fast(model, on)
        out.append(_greedy(model, ids, 8, attention_mask=mask, pad_token_id=0))
    assert torch.equal(out[0], out[1])


def test_chat_stream_runs_over_the_quantized_cache(model: Any) -> None:
    _fast(model, True)
    pieces = list(model.chat_stream(model.tokenizer, "hello", history=None, max_new_tokens=6))
    assert pieces, "chat_stream yielded nothing"
    assert all(getattr(layer, FAST_STEPS) > 0 for layer in _layers(model))


def test_an_extension_without_the_features_runs_the_model_s_own_code(model: Any) -> None:
    class Official:  # what Qwen's own kernels offer: the two matmuls only
        def __init__(self, inner: Any) -> None:
            self.vecquant8matmul_batched_faster_old = inner.vecquant8matmul_batched_faster_old
            self.vecquant8matmul_batched_column_compression_faster_old = (
                inner.vecquant8matmul_batched_column_compression_faster_old
            )

    layers = _layers(model)
    saved = [layer.cache_kernels for layer in layers]
    try:
        for layer in layers:
            layer.cache_kernels = Official(layer.cache_kernels)
        _fast(model, True)
        _greedy(model, torch.tensor(PROMPT), 4)
        assert all(getattr(layer, FAST_STEPS) == 0 for layer in layers)
    finally:
        for layer, kernels in zip(layers, saved):
            layer.cache_kernels = kernels


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_decoding_appends_in_place_without_copying_the_cache(model: Any, mode: str) -> None:
    """Servers decode under inference_mode, where views do not know their base: the buffers
    must still be recognised as the past's own and reused, not copied at every step."""
    _fast(model, True)
    context = torch.inference_mode() if mode == "inference_mode" else torch.no_grad()
    layer = _layers(model)[0]
    seen = []
    with context:
        out = model(torch.tensor(PROMPT), use_cache=True)
        for _ in range(20):
            seen.append(id(layer._qwen_kvprep_buffers))
            nxt = out.logits[:, -1:].argmax(-1)
            out = model(nxt, past_key_values=out.past_key_values, use_cache=True)
    assert len(set(seen)) == 1, f"the buffers were replaced {len(set(seen)) - 1} times"


def test_per_token_prefill_gives_each_prompt_token_its_own_scale(model: Any) -> None:
    _fast(model, True)
    module = sys.modules[type(_layers(model)[0]).__module__.rsplit(".", 1)[0] + ".qwen_kvprep_kv"]
    prompt = torch.tensor(PROMPT)
    try:
        for flag in (False, True):
            module.PER_TOKEN_PREFILL = flag
            with torch.no_grad():
                out = model(prompt, use_cache=True)
                nxt = model(out.logits[:, -1:].argmax(-1), past_key_values=out.past_key_values,
                            use_cache=True)
            key_scales = nxt.past_key_values[0][0][1][0, 0, :, 0]  # layer 0, row 0, head 0
            distinct = len(set(key_scales[: prompt.size(1)].tolist()))
            # per chunk: one value for the whole prompt; per token: one each (fp16 values of
            # two tokens may coincide)
            assert (distinct > prompt.size(1) // 2) if flag else (distinct == 1), (flag, distinct)
    finally:
        module.PER_TOKEN_PREFILL = False


def test_a_new_sequence_lets_go_of_the_last_one_s_buffers_first(model: Any) -> None:
    """A server's next request must not hold two caches at once: when a prefill takes new
    buffers, no layer still holds the buffers of the sequence before (their memory is
    freed as soon as nobody else holds the old cache's views)."""
    import weakref

    _fast(model, True)
    layers = _layers(model)
    with torch.inference_mode():
        model(torch.tensor(PROMPT), use_cache=True)  # the first request, its cache dropped
    old = [weakref.ref(layer._qwen_kvprep_buffers.k) for layer in layers]
    buffers_class = type(layers[0]._qwen_kvprep_buffers)
    alive_at_allocation: list[int] = []
    original_init = buffers_class.__init__

    def counting_init(self: Any, *args: Any, **kwargs: Any) -> None:
        alive_at_allocation.append(sum(ref() is not None for ref in old))
        original_init(self, *args, **kwargs)

    buffers_class.__init__ = counting_init
    try:
        with torch.inference_mode():
            model(torch.tensor(PROMPT), use_cache=True)
    finally:
        buffers_class.__init__ = original_init
    # layer i allocates while layers after it still hold theirs (they have not run yet):
    # what matters is that its own old buffers are gone by then
    assert alive_at_allocation == [len(layers) - 1 - i for i in range(len(layers))]
