"""OpenAI's legacy completions `logprobs` object (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`) for
output tokens and, with `echo`, for the prompt's tokens before them (lm-eval's loglikelihood reads these: the
first prompt token has no logprob, so its entries are null, as in OpenAI's and vLLM's answers)."""

from __future__ import annotations

from typing import Any

from deepserve.core.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from deepserve.server.state import ModelInfo


def output_logprobs(completion: CompletionOutput, start: int, model: ModelInfo, top_n: int) -> dict[str, list]:
    """Output tokens [start, end): their texts, logprobs, the `top_n` most likely, offsets in the output text."""
    entries = completion.logprobs or []
    tokens, token_logprobs, top = [], [], []
    for position in range(start, min(len(completion.token_ids), len(entries))):
        token_id, entry = completion.token_ids[position], entries[position]
        tokens.append(_token_text(token_id, entry, model))
        token_logprobs.append(entry[token_id].logprob)
        top.append(_top(entry, model, top_n))
    offset = len(model.tokenizer.decode(completion.token_ids[:start], False)) if start and model.tokenizer else 0
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
            "text_offset": _offsets(tokens, offset)}


def prompt_logprobs(out: RequestOutput, model: ModelInfo, top_n: int) -> dict[str, list]:
    """The prompt's tokens, each with the logprob the model gave it after the ones before (None for the first)."""
    ids, entries = out.prompt_token_ids or [], out.prompt_logprobs or []
    tokens, token_logprobs, top = [], [], []
    for position, token_id in enumerate(ids):
        entry: PositionLogprobs | None = entries[position] if position < len(entries) else None
        tokens.append(_token_text(token_id, entry, model))
        token_logprobs.append(entry[token_id].logprob if entry is not None else None)
        top.append(_top(entry, model, top_n) if entry is not None else None)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
            "text_offset": _offsets(tokens, 0)}


def joined(prompt: dict[str, list], output: dict[str, list] | None, prompt_chars: int) -> dict[str, list]:
    """The prompt's entries, then the output's, whose offsets move past the `prompt_chars` echoed before them."""
    if output is None:
        return prompt
    return {"tokens": prompt["tokens"] + output["tokens"],
            "token_logprobs": prompt["token_logprobs"] + output["token_logprobs"],
            "top_logprobs": prompt["top_logprobs"] + output["top_logprobs"],
            "text_offset": prompt["text_offset"] + [prompt_chars + o for o in output["text_offset"]]}


def _top(entry: PositionLogprobs, model: ModelInfo, top_n: int) -> dict[str, float]:
    ranked = sorted(entry.items(), key=lambda item: (item[1].rank is None, item[1].rank or 0))
    return {_token_text(t, entry, model): lp.logprob for t, lp in ranked[:top_n]}


def _offsets(tokens: list[str], offset: int) -> list[int]:
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return offsets


def _token_text(token_id: int, entry: Any, model: ModelInfo) -> str:
    decoded = entry[token_id].decoded_token if entry is not None and token_id in entry else None
    if decoded is not None:
        return decoded
    return model.tokenizer.decode([token_id], skip_special_tokens=False) if model.tokenizer else f"<{token_id}>"
