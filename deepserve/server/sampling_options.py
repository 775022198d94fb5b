"""The sampling fields that no protocol parser carries and every OpenAI-shaped route reads the same way: OpenAI's
`presence_penalty`, `frequency_penalty` and `logit_bias`, and vLLM's `repetition_penalty` and `bad_words`.

`penalty_fields(body)` hands them to `SamplingParams`, which judges their values (a 400 naming the field);
`ModelInfo.fit_params` then checks `logit_bias` against the vocabulary and tokenizes `bad_words`.
`sibling_params` gives choice j of an `n` > 1 request its parameters.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from deepserve.core.sampling_params import SamplingParams

PENALTY_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "bad_words")


def penalty_fields(body: dict[str, Any]) -> dict[str, Any]:
    """The penalty fields `body` sets (null is unset), as `SamplingParams` keyword arguments."""
    return {name: body[name] for name in PENALTY_FIELDS if body.get(name) is not None}


def sibling_params(params: SamplingParams, sibling: int) -> SamplingParams:
    """Choice `sibling`'s parameters: the request's, with `seed + sibling` (wrapped to 64 bits) when seeded, so
    the choices differ and each is reproducible (vLLM's rule for n > 1)."""
    if sibling == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=(params.seed + sibling + 2**63) % 2**64 - 2**63)
