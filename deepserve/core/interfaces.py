"""The seams between the engine and the code that touches tensors.

`Backend` is the set of numerical ops the DeepSeek-V4 model needs: the maths ops below, which every accelerator
implements to be correct, and the optional and composed ops of `deepserve.core.fused_ops.FusedOps`, which have
defaults and which a backend overrides only to be faster. The model in `deepserve.model` is written
once against this interface; `deepserve.backends.reference` implements it in plain PyTorch (CPU or CUDA, the
numerical oracle), and accelerator backends override the ops they have kernels for. A backend is chosen at
start-up by the `deepserve_select_backend` hook; nothing looks it up per step.

This module imports nothing from torch at run time (tensors appear only in annotations), so `deepserve.core`
stays torch-free.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from deepserve.core.fused_ops import FusedOps, VisibleRows
from deepserve.core.outputs import PositionLogprobs
from deepserve.core.sampling_params import SamplingParams

# annotations only; on one line so that nothing in deepserve/core reads as a torch import
if TYPE_CHECKING: from torch import Tensor  # noqa: E701


class BackendUnavailable(RuntimeError):
    """The requested accelerator backend cannot run here; the message says what is missing."""




class Backend(FusedOps, ABC):
    """Numerical ops of the V4 forward pass for one accelerator.

    Shapes use T = tokens in the flattened batch (no padding anywhere), H = query heads, d = head dim,
    N = rows in a key/value pool, n = mHC streams, D = hidden size, E = experts.
    Every op is pure: it returns new tensors and never keeps references to its inputs.

    Every op is batch-invariant: a token's result does not depend on which other tokens share the batch or
    where it sits in it. Deterministic serving (a seeded request gets the same tokens alone or in a busy
    batch) rests on this.
    """

    #: short name, as accepted by `DEEPSERVE_ACCELERATOR` (`cpu`, `nvidia`, `ascend`, or a plugin's own)
    name: str = "abstract"

    @property
    @abstractmethod
    def device(self) -> str:
        """The torch device string the model's weights and state live on (e.g. `cpu`, `cuda:0`)."""

    @abstractmethod
    def linear(self, x: Tensor, weight: Tensor) -> Tensor:
        """`x @ weight.T` for x [T, K], weight [N, K]. Batch-invariant: a row's result does not depend on how
        many other rows `x` holds (BLAS libraries switch kernels for small row counts; implementations must not
        let that leak into results)."""

    @abstractmethod
    def grouped_linear(self, x: Tensor, weight: Tensor) -> Tensor:
        """Block-diagonal projection: x [T, G, K], weight [G, N, K] -> [T, G, N], group g through its own
        slice. Batch-invariant like `linear`."""

    @abstractmethod
    def rms_norm(self, x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
        """RMSNorm over the last dim, computed in fp32, returned in `x.dtype`. `weight=None` is unweighted."""

    @abstractmethod
    def apply_rope(
        self, x: Tensor, positions: Tensor, inv_freq: Tensor, inverse: bool = False, inplace: bool = False
    ) -> Tensor:
        """Interleaved (GPT-J) RoPE on the last `2 * len(inv_freq)` dims of `x` [T, ..., d].

        `positions` [T] are absolute positions; `inverse=True` rotates by `-position` (used on the attention
        output, since V = K carries rotated dims). The leading dims pass through unchanged. `inplace=True`: the
        caller no longer needs `x`, so the backend may rotate it in place and return it (or return a new tensor).
        """

    @abstractmethod
    def hc_pre(
        self, streams: Tensor, fn: Tensor, base: Tensor, scale: Tensor, iters: int, hc_eps: float, norm_eps: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        """mHC input side: from the residual streams [T, n, D] compute `pre`, `post` and the Sinkhorn-projected
        `comb`, and collapse the streams with `pre`. Returns (collapsed [T, D], post [T, n], comb [T, n, n])."""

    @abstractmethod
    def hc_post(self, streams: Tensor, block_out: Tensor, post: Tensor, comb: Tensor) -> Tensor:
        """mHC output side: `X'_k = post_k * y + sum_j comb[j, k] * X_j`. Returns the new streams [T, n, D]."""

    @abstractmethod
    def hc_head(self, streams: Tensor, fn: Tensor, base: Tensor, scale: Tensor, hc_eps: float, norm_eps: float) -> Tensor:
        """Final stream collapse (sigmoid weights, no Sinkhorn). Returns [T, D]."""

    @abstractmethod
    def sparse_attention(self, q: Tensor, kv: Tensor, indices: Tensor, sinks: Tensor, scale: float) -> Tensor:
        """MQA over an index list: query t, head h attends to rows `kv[indices[t, :]]` (K = V), entries < 0
        are ignored, and a per-head sink logit `sinks[h]` (zero value) joins the softmax denominator.

        q [T, H, d], kv [N, d], indices [T, K] int64, sinks [H] fp32. Returns [T, H, d] in `q.dtype`.
        """

    @abstractmethod
    def indexer_topk(
        self, q: Tensor, weights: Tensor, keys: Tensor, key_start: Tensor, key_count: Tensor, topk: int
    ) -> Tensor:
        """Lightning-indexer selection. Query t sees keys `keys[key_start[t] : key_start[t] + key_count[t]]`;
        its score for key w is `sum_h weights[t, h] * relu(q[t, h] . keys[w])`. Returns [T, topk] int64
        absolute row numbers into `keys` of the `topk` best keys (ties go to the lowest row), in ascending row
        order, unused slots last as -1.

        q [T, Hi, Di] (scaling already applied by the caller), weights [T, Hi], keys [N, Di].
        """

    @abstractmethod
    def softmax_pool(self, values: Tensor, gates: Tensor) -> Tensor:
        """A compressor's pooling: `sum_s values[b, s] * softmax_s(gates[b, s])`, per channel, over the block's
        slots s. values, gates [B, S, d] (a gate of -inf drops its slot). Returns [B, d] fp32."""

    @abstractmethod
    def route(self, logits: Tensor, bias: Tensor | None, hash_ids: Tensor | None, top_k: int, scale: float):
        """MoE routing from the router's fp32 logits [T, E]: scores `router_scores(logits)`; the experts are
        `hash_ids` [T, k] when given (hash layers), else the top-k of `scores + bias` (the bias steers selection
        only); their weights are the scores, normalised to sum 1 (+1e-20) and times `scale`. Returns
        (ids [T, k] int64, weights [T, k] fp32)."""

    @abstractmethod
    def router_scores(self, logits: Tensor) -> Tensor:
        """The MoE router's activation `sqrt(softplus(logits))`, fp32 [T, E]."""

    @abstractmethod
    def swiglu(self, gate: Tensor, up: Tensor, limit: float) -> Tensor:
        """Clamped SwiGLU: `silu(min(gate, limit)) * clamp(up, -limit, limit)`."""

    @abstractmethod
    def moe_experts(
        self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w13: Tensor, w2: Tensor, limit: float
    ) -> Tensor:
        """Routed experts: `sum_k topk_weights[t, k] * W2_e(silu(min(g, limit)) * clamp(u, -limit, limit))` with
        `[g; u] = W13_e x` for e = topk_ids[t, k]. x [T, D], w13 [E, 2I, D], w2 [E, D, I]. Returns [T, D]."""

    @abstractmethod
    def sample(
        self,
        logits: Tensor,
        temperature: Tensor,
        top_k: Tensor,
        top_p: Tensor,
        min_p: Tensor,
        seeds: Tensor,
        positions: Tensor,
    ) -> Tensor:
        """Sample one token per row of `logits` [B, V] (fp32).

        Per-row tensors [B]: temperature (0 = greedy argmax, lowest id on ties), top_k (0 or >= V = off),
        top_p (1 = off), min_p (0 = off), seeds (int64) and positions (int64: index of the token being
        sampled). The randomness of a row is a function of (seed, position) only, so a seeded request draws
        the same tokens whatever else is in the batch. Returns [B] int64.
        """


# -- the engine core <-> model runner seam ------------------------------------------------------------------------
# Value objects only: the runner never sees a live Request.

#: a token id the runner takes from its previous step's samples (asynchronous scheduling)
PLACEHOLDER = -1
#: a draft token the runner takes from the drafts its previous step made (asynchronous speculative decoding)
DRAFT_PLACEHOLDER = -2


class ChunkInput(NamedTuple):
    """One request's tokens for one step (a named tuple, not a frozen dataclass: the engine builds one per request
    per step, and a frozen dataclass's `__init__` sets each of these 17 fields through `object.__setattr__`, several
    times a tuple's cost; bench/runner_host.py measures the host's step).

    `token_ids` cover positions [start, start + len); `PLACEHOLDER` entries are the tokens the previous step sampled
    for this request. A request the runner has no state for starts at `start` (0, or a prefix-cache hit whose
    boundary state the cache restores). `block_table` lists the request's pages so far. `samples`: draw the next
    token from the last position's logits, with `params` and `seed`, never drawing `blocked_token_ids`.
    `prompt_targets`: for prompt-logprob requests, the next prompt token of each leading chunk position.
    `snapshots`: (page boundary, page) pairs inside (start, end] at which to save prefix-hit state.

    Speculative decoding: the last `num_draft_tokens` entries of `token_ids` are drafts to verify (the chunk
    samples; the runner keeps a prefix of them and rolls its state back past the rest). `next_token_id` is the
    token after the chunk when the chunk does not sample (the drafter pairs every position with its next
    token). `num_speculative_tokens`: how many tokens to draft for this request after the step (0: none).
    With asynchronous scheduling the drafts may be `DRAFT_PLACEHOLDER`s (the drafts the previous step makes),
    and a chunk planned while the request's previous verify step is still running is `relative`: it continues
    wherever that step's kept drafts leave the sequence, so the runner ignores `start` (an upper bound) and
    computes the page snapshots itself. `exact_drafts`: the drafts are tokens the request's grammar forces, not
    the drafter's; each is kept when it equals the token the target samples at its position (greedy or with the
    request's own seed), so the tokens are exactly those of plain decoding.

    Logits processing that reads what the request generated (`SamplingParams.reads_output_history`: penalties,
    multi-token bad words) gets, on its sampling chunks, `output_token_ids`: the output tokens known when the step
    was planned (the chunk's `PLACEHOLDER`s are the ones after them), and for a repetition penalty
    `prompt_token_ids`. Empty for every other chunk.
    """

    request_id: str
    start: int
    token_ids: tuple[int, ...]
    samples: bool
    block_table: tuple[int, ...]
    params: SamplingParams
    seed: int
    blocked_token_ids: tuple[int, ...] = ()
    prompt_targets: tuple[int, ...] = ()
    snapshots: tuple[tuple[int, int], ...] = ()
    num_draft_tokens: int = 0
    next_token_id: int | None = None
    num_speculative_tokens: int = 0
    relative: bool = False
    exact_drafts: bool = False
    output_token_ids: tuple[int, ...] = ()
    prompt_token_ids: Sequence[int] = ()


@dataclass(frozen=True, slots=True)
class StepMasks:
    """Grammar token masks for a step's constrained sampling chunks (structured output).

    The host fills them while the step's forward runs: the runner waits on `bitmask` just before sampling.
    Row i of the bitmask masks the sampled row of chunk `chunk_indices[i]`: a CPU int32 tensor
    [len(chunk_indices), ceil(V / 32)] whose bit j of word w allows token 32 * w + j (rows of requests that
    finished meanwhile allow everything; their token is discarded). The future may give None: mask nothing.

    With speculative decoding a verifying chunk has 1 + k sampled rows (its drafts, then the bonus):
    `rows_per_chunk[i]` bitmask rows, consecutive, mask chunk `chunk_indices[i]`'s rows in order (empty: one
    row each). Rows past a draft the grammar rejects may be left unfilled: the verifier never samples there.
    """

    chunk_indices: tuple[int, ...]
    bitmask: Future
    rows_per_chunk: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class StepInput:
    """One step for the runner: drop the state of `freed_request_ids` (finished or preempted), then compute.
    `masks`: the grammar masks of its constrained sampling chunks, if any."""

    chunks: tuple[ChunkInput, ...]
    freed_request_ids: tuple[str, ...] = ()
    masks: StepMasks | None = None


@dataclass(slots=True)
class StepOutput:
    """What a step produced, per request id. `seconds`: how long the step took on the runner (the cost model's
    measure: device time where the runner can time the device, else wall time), of which `mask_wait_seconds`
    waiting for the host's grammar masks.

    The executor may return before the step's samples are on the host (the device still computing them), so
    that the engine can launch the next step meanwhile: `pending` then holds the rest of the step, and
    `resolve()` waits for the samples and fills `sampled` (and `seconds`). Read nothing before `resolve()`.

    Speculative decoding: `num_accepted` is how many of a verifying chunk's drafts were kept (its `sampled`
    token follows them); `draft_token_ids` / `draft_confidences` are the drafts made for the next step."""

    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, PositionLogprobs] = field(default_factory=dict)
    sampled_logprobs: dict[str, float] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)
    seconds: float = 0.0
    mask_wait_seconds: float = 0.0
    num_accepted: dict[str, int] = field(default_factory=dict)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    draft_confidences: dict[str, list[float]] = field(default_factory=dict)
    pending: Callable[[], None] | None = field(default=None, compare=False, repr=False)

    def resolve(self) -> StepOutput:
        """Wait for the step's samples to reach the host and fill this output: runs `pending` once (an output
        that came back complete has none). An error of the step's device work surfaces here."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending()
        return self


class ModelExecutor(ABC):
    """Runs steps on a device. Called from one thread at a time, in step order; a step may read the samples of
    the step before it (placeholders), so steps must execute in the order they are submitted."""

    @abstractmethod
    def execute(self, step: StepInput) -> StepOutput:
        """Launch one step and return its output, which may still be pending (`StepOutput.resolve`): the step's
        one device-to-host copy of its samples need not have finished, so that the caller can submit the next
        step while the device computes this one."""

    @property
    @abstractmethod
    def num_free_slots(self) -> int:
        """How many more sequences can hold state at once."""
