"""What the front and the ranks say to each other over ZMQ, as msgspec structs (msgpack on the wire).

Front -> rank: `AddRequest`, `Abort`, `Shutdown`. Rank -> front: `Ready` once it has loaded, `StepOutputs`
after a step that changed something (its requests' outputs and the rank's counters), `RankFailed` when it
stops on an error. `SamplingParams` and `RequestOutput` are the engine's dataclasses; they cross as the
structs below and are rebuilt on the other side, validated again by their own constructors.
"""

from __future__ import annotations

import dataclasses
from typing import Union

import msgspec

from deepserve.core.engine import EngineSnapshot
from deepserve.core.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from deepserve.core.sampling_params import SamplingParams
from deepserve.core.structured import GrammarSpec


class WireLogprob(msgspec.Struct, array_like=True):
    logprob: float
    rank: int | None
    decoded_token: str | None


class WireCompletion(msgspec.Struct):
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, WireLogprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None


class WireMetrics(msgspec.Struct, array_like=True):
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float | None


class WireOutput(msgspec.Struct):
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: list[dict[int, WireLogprob] | None] | None
    outputs: list[WireCompletion]
    finished: bool
    num_cached_tokens: int
    metrics: WireMetrics | None
    num_draft_tokens: int
    num_verified_tokens: int
    num_accepted_tokens: int


#: an `EngineSnapshot` as msgspec encodes a dataclass (a map of its fields, nested dataclasses too), rebuilt by
#: `msgspec.convert`, so that new counters cross without a change here
WireSnapshot = dict


class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: dict
    prompt: str | None
    cache_salt: str | None
    final_only: bool


class Abort(msgspec.Struct, tag=True):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag=True):
    pass


class Ready(msgspec.Struct, tag=True):
    rank: int
    max_model_len: int
    max_num_seqs: int
    weight_bytes: int
    snapshot: WireSnapshot


class StepOutputs(msgspec.Struct, tag=True):
    rank: int
    outputs: list[WireOutput]
    snapshot: WireSnapshot
    num_expert_moves: int = 0  # EPLB reassignments this rank has made
    imbalance: list[float] | None = None  # EPLB's latest per-site imbalance (slowest rank over mean)
    num_slots_moved: int = 0  # expert slots of this rank whose expert those reassignments changed


class RankFailed(msgspec.Struct, tag=True):
    rank: int
    error: str


ToRank = Union[AddRequest, Abort, Shutdown]
ToFront = Union[Ready, StepOutputs, RankFailed]
to_rank_encoder = to_front_encoder = msgspec.msgpack.Encoder()
to_rank_decoder = msgspec.msgpack.Decoder(ToRank)
to_front_decoder = msgspec.msgpack.Decoder(ToFront)


# -- conversions ------------------------------------------------------------------------------------------------
def params_to_wire(params: SamplingParams) -> dict:
    fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    if isinstance(fields["structured_outputs"], GrammarSpec):
        fields["structured_outputs"] = dataclasses.asdict(fields["structured_outputs"])
    return fields


def params_from_wire(fields: dict) -> SamplingParams:
    fields = dict(fields)
    if fields.get("structured_outputs") is not None:
        fields["structured_outputs"] = GrammarSpec(**fields["structured_outputs"])
    if fields.get("logit_bias") is not None:
        fields["logit_bias"] = {int(k): v for k, v in fields["logit_bias"].items()}
    return SamplingParams(**fields)


def _lp_to_wire(position):
    return None if position is None else {t: WireLogprob(lp.logprob, lp.rank, lp.decoded_token)
                                           for t, lp in position.items()}


def _lp_from_wire(position):
    return None if position is None else {t: Logprob(lp.logprob, lp.rank, lp.decoded_token)
                                           for t, lp in position.items()}


def output_to_wire(out: RequestOutput) -> WireOutput:
    m = out.metrics
    return WireOutput(
        out.request_id, out.prompt, list(out.prompt_token_ids) if out.prompt_token_ids is not None else None,
        [_lp_to_wire(p) for p in out.prompt_logprobs] if out.prompt_logprobs is not None else None,
        [WireCompletion(c.index, c.text, list(c.token_ids), c.cumulative_logprob,
                        [_lp_to_wire(p) for p in c.logprobs] if c.logprobs is not None else None,
                        c.finish_reason, c.stop_reason) for c in out.outputs],
        out.finished, out.num_cached_tokens,
        None if m is None else WireMetrics(m.arrival_time, m.first_scheduled_time, m.first_token_time,
                                           m.last_token_time, m.finished_time),
        out.num_draft_tokens, out.num_verified_tokens, out.num_accepted_tokens)


def output_from_wire(w: WireOutput) -> RequestOutput:
    m = w.metrics
    return RequestOutput(
        w.request_id, w.prompt, w.prompt_token_ids,
        [_lp_from_wire(p) for p in w.prompt_logprobs] if w.prompt_logprobs is not None else None,
        [CompletionOutput(c.index, c.text, c.token_ids, c.cumulative_logprob,
                          [_lp_from_wire(p) for p in c.logprobs] if c.logprobs is not None else None,
                          c.finish_reason, c.stop_reason) for c in w.outputs],
        w.finished, w.num_cached_tokens,
        None if m is None else RequestMetrics(m.arrival_time, m.first_scheduled_time, m.first_token_time,
                                              m.last_token_time, m.finished_time),
        w.num_draft_tokens, w.num_verified_tokens, w.num_accepted_tokens)


def snapshot_to_wire(s: EngineSnapshot) -> dict:
    return msgspec.to_builtins(s)


def snapshot_from_wire(w: dict) -> EngineSnapshot:
    return msgspec.convert(w, EngineSnapshot)
