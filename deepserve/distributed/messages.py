"""What the front and the ranks say to each other over ZMQ, as msgspec structs (msgpack on the wire).

Front -> rank: `AddRequest`, `Abort`, `Shutdown`. Rank -> front: `Ready` once it has loaded, `StepOutputs`
after a step that changed something (its requests' outputs and the rank's counters), `RankFailed` when it
stops on an error. `SamplingParams` and `RequestOutput` are the engine's dataclasses; they cross as the
structs below and are rebuilt on the other side, validated again by their own constructors.

An output crosses as what changed since its request's last one (vLLM's engine core sends deltas too): the
tokens, logprobs and text after those already sent (`OutputDeltas`, on the rank), appended on the front to what
it holds of the request (`OutputAccumulator`), which also keeps the prompt it sent. A cumulative snapshot would
carry every request's prompt and whole output again each step: at 256 streams of 512-token prompts, 400 KB and
~4 ms of decoding a step on the front's thread.
"""

from __future__ import annotations

import dataclasses
from typing import Union

import msgspec

from deepserve.core.engine import EngineSnapshot
from deepserve.core.outputs import CompletionOutput, Logprob, Prefix, RequestMetrics, RequestOutput
from deepserve.core.sampling_params import SamplingParams
from deepserve.core.structured import GrammarSpec


class WireLogprob(msgspec.Struct, array_like=True):
    logprob: float
    rank: int | None
    decoded_token: str | None


class WireCompletion(msgspec.Struct, array_like=True):
    """One completion's change: keep the first `*_kept` items of what the front holds, then append these."""

    index: int
    text_kept: int
    text: str
    tokens_kept: int
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs_kept: int
    logprobs: list[dict[int, WireLogprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None


class WireMetrics(msgspec.Struct, array_like=True):
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float | None


class WireOutput(msgspec.Struct, array_like=True):
    """A `RequestOutput` without its prompt (the front has it) and with its completions as changes."""

    request_id: str
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


class OutputDeltas:
    """The rank's side: each output as its change since the request's last output sent (see the module
    docstring). Tokens and logprobs only grow once shown (the engine cuts only what no output has shown); text
    that did not (a final output's cut at a stop string) is sent whole."""

    def __init__(self) -> None:
        self._sent: dict[tuple[str, int], tuple[int, str, int]] = {}  # (tokens, text, logprobs) sent

    def to_wire(self, out: RequestOutput) -> WireOutput:
        m = out.metrics
        completions = []
        for c in out.outputs:
            key = (out.request_id, c.index)
            num_tokens, text, num_logprobs = (self._sent.pop(key, None) if out.finished else
                                              self._sent.get(key)) or (0, "", 0)
            tokens, logprobs = c.token_ids, c.logprobs
            tokens_kept = min(num_tokens, len(tokens))
            text_kept = len(text) if c.text.startswith(text) else 0
            logprobs_kept = min(num_logprobs, len(logprobs)) if logprobs is not None else 0
            completions.append(WireCompletion(
                c.index, text_kept, c.text[text_kept:], tokens_kept, tokens[tokens_kept:], c.cumulative_logprob,
                logprobs_kept, [_lp_to_wire(p) for p in logprobs[logprobs_kept:]] if logprobs is not None else None,
                c.finish_reason, c.stop_reason))
            if not out.finished:
                self._sent[key] = (len(tokens), c.text, len(logprobs) if logprobs is not None else 0)
        return WireOutput(
            out.request_id,
            [_lp_to_wire(p) for p in out.prompt_logprobs] if out.prompt_logprobs is not None else None,
            completions, out.finished, out.num_cached_tokens,
            None if m is None else WireMetrics(m.arrival_time, m.first_scheduled_time, m.first_token_time,
                                               m.last_token_time, m.finished_time),
            out.num_draft_tokens, out.num_verified_tokens, out.num_accepted_tokens)


class _Held:
    """What the front holds of one request: its prompt, and each completion's tokens, text and logprobs so far."""

    __slots__ = ("prompt", "prompt_token_ids", "views", "completions")

    def __init__(self, prompt: str | None, prompt_token_ids: list[int], views: bool) -> None:
        self.prompt, self.prompt_token_ids, self.views = prompt, prompt_token_ids, views
        self.completions: dict[int, list] = {}  # index -> [token ids, text, logprobs or None]


class OutputAccumulator:
    """The front's side: each request's outputs rebuilt from its rank's changes, as `EngineCore` makes them
    (`views`: an unfinished output's token ids and logprobs are `Prefix` views of the lists held here, else
    copies; a final output gets the lists themselves, which are then let go)."""

    def __init__(self) -> None:
        self._held: dict[str, _Held] = {}

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], views: bool) -> None:
        self._held[request_id] = _Held(prompt, prompt_token_ids, views)

    def drop(self, request_id: str) -> None:
        self._held.pop(request_id, None)

    def from_wire(self, w: WireOutput) -> RequestOutput:
        held = self._held.pop(w.request_id, None) if w.finished else self._held.get(w.request_id)
        if held is None:  # (not added here: a front that did not send it; nothing to append to)
            held = _Held(None, [], False)
        completions = []
        for c in w.outputs:
            state = held.completions.get(c.index)
            if state is None:
                state = held.completions[c.index] = [[], "", None if c.logprobs is None else []]
            tokens = state[0]
            del tokens[c.tokens_kept:]
            tokens.extend(c.token_ids)
            state[1] = state[1][:c.text_kept] + c.text
            logprobs = state[2]
            if c.logprobs is not None:
                if logprobs is None:
                    logprobs = state[2] = []
                del logprobs[c.logprobs_kept:]
                logprobs.extend(_lp_from_wire(p) for p in c.logprobs)
            if w.finished:
                token_view, logprob_view = tokens, logprobs
            elif held.views:
                token_view = Prefix(tokens, len(tokens))
                logprob_view = Prefix(logprobs, len(logprobs)) if logprobs is not None else None
            else:
                token_view, logprob_view = list(tokens), list(logprobs) if logprobs is not None else None
            completions.append(CompletionOutput(c.index, state[1], token_view, c.cumulative_logprob, logprob_view,
                                                c.finish_reason, c.stop_reason))
        m = w.metrics
        return RequestOutput(
            w.request_id, held.prompt, held.prompt_token_ids,
            [_lp_from_wire(p) for p in w.prompt_logprobs] if w.prompt_logprobs is not None else None,
            completions, w.finished, w.num_cached_tokens,
            None if m is None else RequestMetrics(m.arrival_time, m.first_scheduled_time, m.first_token_time,
                                                  m.last_token_time, m.finished_time),
            w.num_draft_tokens, w.num_verified_tokens, w.num_accepted_tokens)


def snapshot_to_wire(s: EngineSnapshot) -> dict:
    return msgspec.to_builtins(s)


def snapshot_from_wire(w: dict) -> EngineSnapshot:
    return msgspec.convert(w, EngineSnapshot)
