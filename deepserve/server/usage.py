"""Output usage counted from the engine's token ids, for the three protocols deepseek-recipe answers.

The recipe's stream processor counts output tokens from the text it has decoded (a final token that ends inside
a UTF-8 character is left out) and reasoning tokens from the reasoning text, so `reasoning_tokens` could exceed
`completion_tokens` (541 of 536). `OutputUsage` counts instead what the engine generated and the processor was
given: every output token (a final EOS included, as the engine and `deepserve_generation_tokens_total` count
it), and as reasoning the tokens before the end-of-thinking token when the response starts in reasoning.
`patch` writes these counts into the usage of the protocol's final event or accumulated response, with
`reasoning_tokens` (0 without thinking) always present in OpenAI's chat and Responses usages, as OpenAI sends it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any


class OutputUsage:
    """The output counts of one response. `thinking_end_id`: the single token that ends the reasoning (None:
    this tokenizer has none, and the recipe's reasoning count is kept, capped at the output count)."""

    __slots__ = ("num_tokens", "num_reasoning_tokens", "in_reasoning", "thinking_end_id")

    def __init__(self, starts_in_reasoning: bool, thinking_end_id: int | None) -> None:
        self.num_tokens = 0
        self.num_reasoning_tokens = 0
        self.in_reasoning = starts_in_reasoning
        self.thinking_end_id = thinking_end_id

    def add(self, token_ids: Iterable[int], text: bool = True) -> None:
        """Count output tokens; `text=False` for a final EOS (an output token, never reasoning)."""
        for token_id in token_ids:
            self.num_tokens += 1
            if not (text and self.in_reasoning):
                continue
            if token_id == self.thinking_end_id:
                self.in_reasoning = False
            else:
                self.num_reasoning_tokens += 1

    def patch(self, data: str) -> str:
        """`data` (an event's or a response's JSON) with these counts in its usage; unchanged without usage."""
        if '"usage"' not in data:
            return data
        body = json.loads(data)
        usage = _usage_of(body)
        if usage is None:
            return data
        for output, prompt, details in (("completion_tokens", "prompt_tokens", "completion_tokens_details"),
                                        ("output_tokens", "input_tokens", "output_tokens_details")):
            if output not in usage:
                continue
            usage[output] = self.num_tokens
            if "total_tokens" in usage:
                usage["total_tokens"] = usage.get(prompt, 0) + self.num_tokens
            if usage.get(details) is None and "total_tokens" in usage:
                # OpenAI's chat and Responses usages always carry the reasoning count (0 without thinking), which
                # clients read without a None check; the recipe leaves the object out (Anthropic's has none)
                usage[details] = {"reasoning_tokens": 0}
            if isinstance(usage.get(details), dict) and "reasoning_tokens" in usage[details]:
                usage[details]["reasoning_tokens"] = self._reasoning(usage[details]["reasoning_tokens"])
        return json.dumps(body, ensure_ascii=False)

    def _reasoning(self, counted_by_recipe: Any) -> int:
        if self.thinking_end_id is None:
            return min(counted_by_recipe if type(counted_by_recipe) is int else 0, self.num_tokens)
        return self.num_reasoning_tokens


def _usage_of(body: Any) -> dict | None:
    """Chat chunks and responses, Messages events and responses: `usage`; Responses events: `response.usage`."""
    if not isinstance(body, dict):
        return None
    for holder in (body, body.get("response")):
        if isinstance(holder, dict) and isinstance(holder.get("usage"), dict):
            return holder["usage"]
    return None
