"""The sampling fields that no protocol parser carries and every OpenAI-shaped route reads the same way: OpenAI's
`presence_penalty`, `frequency_penalty` and `logit_bias`, and vLLM's `repetition_penalty` and `bad_words`.

`penalty_fields(body)` hands them to `SamplingParams`, which judges their values (a 400 naming the field);
`ModelInfo.fit_params` then checks `logit_bias` against the vocabulary and tokenizes `bad_words`.
`cache_fields(body)` does the same for deepserve's `cache_ttl` (the retention class of the KV blocks the request
writes to the block store, docs/cache.md), on every generation route, top-level or inside a literal
`extra_body` object (what vLLM's docs show clients sending; the openai SDK's `extra_body=` merges it top-level).
`sibling_params` gives choice j of an `n` > 1 request its parameters.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from deepserve.core.sampling_params import SamplingParams
from deepserve.server.errors import ApiError
from deepserve.server.http import json_type

PENALTY_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "bad_words")


def penalty_fields(body: dict[str, Any]) -> dict[str, Any]:
    """The penalty fields `body` sets (null is unset), as `SamplingParams` keyword arguments."""
    return {name: body[name] for name in PENALTY_FIELDS if body.get(name) is not None}


#: deepserve's request fields that `SamplingParams` carries to the KV cache (not sampling, but per request)
CACHE_FIELDS = ("cache_ttl",)


def cache_fields(body: dict[str, Any]) -> dict[str, Any]:
    """The cache fields `body` sets, top-level or in `extra_body` (null is unset), as `SamplingParams` keyword
    arguments. 400 for an `extra_body` that is not an object, holds another field (which would otherwise be
    silently ignored: only these are read from it), or disagrees with the top-level field."""
    extra = body.get("extra_body")
    if extra is not None and not isinstance(extra, dict):
        raise ApiError(400, f"'extra_body' must be an object, got {json_type(extra)}", param="extra_body")
    other = sorted(set(extra or ()) - set(CACHE_FIELDS))
    if other:
        raise ApiError(400, f"'extra_body.{other[0]}' is not read: only {', '.join(CACHE_FIELDS)} may be sent in "
                       "'extra_body' (send other fields top-level, as the openai SDK's extra_body= does)",
                       param=f"extra_body.{other[0]}")
    fields = {}
    for name in CACHE_FIELDS:
        top, nested = body.get(name), (extra or {}).get(name)
        if top is not None and nested is not None and top != nested:
            raise ApiError(400, f"'{name}' ({top!r:.20}) and 'extra_body.{name}' ({nested!r:.20}) differ: send one "
                           "of them", param=name)
        if top is not None or nested is not None:
            fields[name] = top if top is not None else nested
    return fields


def sibling_params(params: SamplingParams, sibling: int) -> SamplingParams:
    """Choice `sibling`'s parameters: the request's, with `seed + sibling` (wrapped to 64 bits) when seeded, so
    the choices differ and each is reproducible (vLLM's rule for n > 1)."""
    if sibling == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=(params.seed + sibling + 2**63) % 2**64 - 2**63)
