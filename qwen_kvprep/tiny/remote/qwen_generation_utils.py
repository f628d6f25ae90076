# Chat prompt helpers for the tiny Qwen (v1) compatible checkpoints of qwen-kvprep.
# Written for qwen-kvprep from the description of the ChatML format that Qwen v1 uses.
from typing import List, Optional, Sequence, Tuple

import torch
from transformers import PreTrainedTokenizer
from transformers.generation.logits_process import LogitsProcessor

HistoryType = List[Tuple[str, str]]
TokensType = List[int]

DEFAULT_SYSTEM = "You are a helpful assistant."


def get_stop_words_ids(chat_format: str, tokenizer: PreTrainedTokenizer) -> List[List[int]]:
    """Token sequences that end an answer in the given chat format."""
    if chat_format == "raw":
        return [tokenizer.encode("Human:"), [tokenizer.eod_id]]
    if chat_format == "chatml":
        return [[tokenizer.im_end_id], [tokenizer.im_start_id]]
    raise NotImplementedError(f"Unknown chat format {chat_format!r}")


def _chatml_turn(tokenizer: PreTrainedTokenizer, role: str, content: str) -> Tuple[str, TokensType]:
    # A turn is "<|im_start|>role\ncontent<|im_end|>"; the special tokens are added as
    # ids so that user text can never smuggle them in.
    text = f"{role}\n{content}"
    tokens = (
        [tokenizer.im_start_id]
        + tokenizer.encode(text, allowed_special=set())
        + [tokenizer.im_end_id]
    )
    return f"<|im_start|>{text}<|im_end|>", tokens


def make_context(
    tokenizer: PreTrainedTokenizer,
    query: str,
    history: Optional[HistoryType] = None,
    system: str = "",
    max_window_size: int = 6144,
    chat_format: str = "chatml",
) -> Tuple[str, TokensType]:
    """The prompt text and tokens for `query` after `history` (oldest turns dropped first)."""
    history = list(history or [])
    if chat_format == "raw":
        return query, tokenizer.encode(query)
    if chat_format != "chatml":
        raise NotImplementedError(f"Unknown chat format {chat_format!r}")

    newline = tokenizer.encode("\n")
    system_text, system_tokens = _chatml_turn(tokenizer, "system", system)

    kept_text = ""
    kept_tokens: TokensType = []
    for turn_query, turn_response in reversed(history):
        q_text, q_tokens = _chatml_turn(tokenizer, "user", turn_query)
        r_text, r_tokens = _chatml_turn(tokenizer, "assistant", turn_response)
        turn_tokens = newline + q_tokens + newline + r_tokens
        turn_text = f"\n{q_text}\n{r_text}"
        if len(system_tokens) + len(turn_tokens) + len(kept_tokens) >= max_window_size:
            break
        kept_tokens = turn_tokens + kept_tokens
        kept_text = turn_text + kept_text

    q_text, q_tokens = _chatml_turn(tokenizer, "user", query)
    assistant_start = [tokenizer.im_start_id] + tokenizer.encode("assistant") + newline
    raw_text = f"{system_text}{kept_text}\n{q_text}\n<|im_start|>assistant\n"
    tokens = system_tokens + kept_tokens + newline + q_tokens + newline + assistant_start
    return raw_text, tokens


def decode_tokens(
    tokens: Sequence[int],
    tokenizer: PreTrainedTokenizer,
    raw_text_len: int,
    context_length: int,
    chat_format: str = "chatml",
    verbose: bool = False,
    return_end_reason: bool = False,
    errors: str = "replace",
):
    """The answer part of a generated sequence, cut at the first stop token."""
    if torch.is_tensor(tokens):
        tokens = tokens.tolist()
    answer = list(tokens[context_length:])
    stops = {tokenizer.im_start_id, tokenizer.im_end_id, tokenizer.eod_id}
    end_reason = f"Gen length {len(answer)}"
    for i, tok in enumerate(answer):
        if tok in stops:
            end_reason = f"Gen {tokenizer.decode([tok])!r}"
            answer = answer[:i]
            break
    text = tokenizer.decode(answer, errors=errors).strip()
    if verbose:
        print("\nRaw Generate:", tokenizer.decode(tokens, errors=errors)[raw_text_len:])
        print("\nEnd Reason:", end_reason)
    if return_end_reason:
        return text, end_reason
    return text


class StopWordsLogitsProcessor(LogitsProcessor):
    """Forces `eos_token_id` once a sequence ends with one of `stop_words_ids`."""

    def __init__(self, stop_words_ids: Sequence[Sequence[int]], eos_token_id: int):
        if not stop_words_ids:
            raise ValueError("stop_words_ids must be a non-empty list of token lists")
        self.stop_words_ids = [list(s) for s in stop_words_ids if len(s) > 0]
        self.eos_token_id = eos_token_id

    def _stopped(self, row: List[int]) -> bool:
        return any(len(s) <= len(row) and row[-len(s):] == s for s in self.stop_words_ids)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        for i, row in enumerate(input_ids.tolist()):
            if self._stopped(row):
                scores[i, :] = float("-inf")
                scores[i, self.eos_token_id] = 0.0
        return scores
