"""The sampling fields both endpoints share (OpenAI's and vLLM's names), their mapping to
`SamplingParams`, and logprobs in OpenAI's two response shapes.

Type errors are pydantic's 422; values out of range are `SamplingParams`' ValueError,
answered 400 naming the field. A logprob of -inf (a banned token) is sent as -9999.0, as
vLLM does: JSON has no infinity.
"""

from __future__ import annotations

import copy
import math
from typing import Any

from pydantic import BaseModel, ConfigDict

from vlmserve.engine.detokenizer import direct_decoder
from vlmserve.sample.logprobs import TokenLogprob

LOGPROB_FLOOR = -9999.0


class SamplingFields(BaseModel):
    """Fields mixed into both request models; None means the default."""

    model_config = ConfigDict(extra="allow")

    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # Extensions (vLLM's names), sent with the client's `extra_body`.
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    bad_words: list[str] | None = None

    def control_kwargs(self) -> dict[str, Any]:
        """SamplingParams keyword arguments for the fields that were sent."""
        kw: dict[str, Any] = {"n": self.n}
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
            value = getattr(self, name)
            if value is not None:
                kw[name] = value
        if self.min_tokens is not None:
            kw["min_tokens"] = self.min_tokens
        if self.bad_words:
            kw["bad_words"] = tuple(self.bad_words)
        if self.logit_bias:
            kw["logit_bias"] = _bias(self.logit_bias)
        return kw


def _bias(logit_bias: dict[str, float]) -> tuple[tuple[int, float], ...]:
    pairs = []
    for key, value in logit_bias.items():
        try:
            token = int(key)
        except ValueError:
            raise ValueError(f"logit_bias: key {key!r} is not a token id") from None
        pairs.append((token, value))
    return tuple(pairs)


class TokenTexts:
    """Token id -> text for logprobs, on the event loop thread: through `backend` (the
    prompt processor's private Rust tokenizer, which any thread may call) where it gives
    the tokenizer's own text, else a tokenizer copy of its own (HF tokenizers are not safe
    to share across threads)."""

    def __init__(self, tokenizer, backend: object | None = None) -> None:
        decoder = direct_decoder(tokenizer, backend) if backend is not None else tokenizer
        self._decoder = copy.deepcopy(tokenizer) if decoder is tokenizer else decoder
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._decoder.decode([token_id])
        return text

    def decode(self, token_ids: list[int]) -> str:
        return self._decoder.decode(token_ids)


def _lp(value: float) -> float:
    return max(value, LOGPROB_FLOOR) if not math.isnan(value) else LOGPROB_FLOOR


def _entry(token_id: int, logprob: float, texts: TokenTexts) -> dict[str, Any]:
    text = texts(token_id)
    return {"token": text, "logprob": _lp(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(records: list[TokenLogprob], texts: TokenTexts) -> dict[str, Any]:
    """Chat's shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""
    content = []
    for record in records:
        entry = _entry(record.token_id, record.logprob, texts)
        entry["top_logprobs"] = [_entry(t, lp, texts) for t, lp in record.top]
        content.append(entry)
    return {"content": content}


def completion_logprobs(
    records: list[TokenLogprob], texts: TokenTexts, offset: int = 0, first: int | None = None
) -> dict[str, Any]:
    """Completions' shape: parallel lists; `offset`: text_offset of the first token.
    `first`: a leading token with no logprob (an echoed prompt's first: nothing predicts
    it), sent with nulls."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    if first is not None:
        tokens.append(texts(first))
        token_logprobs.append(None)
        tops.append(None)
        offsets.append(offset)
        offset += len(tokens[0])
    for record in records:
        offsets.append(offset)
        text = texts(record.token_id)
        offset += len(text)
        tokens.append(text)
        token_logprobs.append(_lp(record.logprob))
        tops.append({texts(t): _lp(lp) for t, lp in record.top})
    return {
        "tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
        "text_offset": offsets,
    }  # fmt: skip


def vllm_logprobs(record: TokenLogprob, texts: TokenTexts) -> dict[str, Any]:
    """vLLM's prompt_logprobs entry: {token id: {logprob, rank, decoded_token}} for the
    token and its top alternatives (a top token's rank is its place in the list)."""
    out = {
        str(t): {"logprob": _lp(lp), "rank": i + 1, "decoded_token": texts(t)}
        for i, (t, lp) in enumerate(record.top)
    }
    out[str(record.token_id)] = {
        "logprob": _lp(record.logprob), "rank": record.rank,
        "decoded_token": texts(record.token_id),
    }  # fmt: skip
    return out
