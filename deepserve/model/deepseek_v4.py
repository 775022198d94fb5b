"""The DeepSeek-V4 causal LM: a batched, variable-length forward over caller-owned per-sequence state.

Module and parameter names equal Hugging Face's in-memory names (`model.layers.3.self_attn.q_a_proj.weight`,
`lm_head.weight`), plus `mtp.{k}.*` for the multi-token-prediction blocks, so a canonical state dict from
`deepserve.model.loader` loads by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from deepserve.core.config import ModelConfig
from deepserve.core.interfaces import Backend

from .attention import Attention
from .batch import ForwardBatch, check_states
from .common import NormWeight, linear, share_inputs
from .decoder import DecoderLayer
from .layouts import StepLayout, layout_for
from .mhc import HyperHead
from .moe import SharedExpert
from .mtp import MTPBlock
from .state import AttentionState, LayerStateSpec, SequenceState, contiguous_state


@dataclass(frozen=True, slots=True)
class ForwardOutput:
    """`streams`: last layer's mHC state [T, n, D] (the MTP input); `logits` [L, V] fp32 for the requested rows;
    `hidden` [L, D]: the normed hidden state the LM head read for those rows (set by `mtp_forward`, whose drafts'
    confidence features need it; None from the main forward)."""

    streams: torch.Tensor
    logits: torch.Tensor
    hidden: torch.Tensor | None = None


class DeepseekV4Body(nn.Module):
    """Embedding, decoder layers, final mHC head and norm (HF's `DeepseekV4Model`, `model.` prefix)."""

    def __init__(self, cfg: ModelConfig, backend: Backend):
        super().__init__()
        self.cfg, self.backend = cfg, backend
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, backend, lt, mt) for lt, mt in zip(cfg.layer_types, cfg.mlp_layer_types)
        )
        self.norm = NormWeight(cfg.hidden_size)
        self.hc_head = HyperHead(cfg, backend)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The first layer's streams [T, n, D]: each token's embedding in every stream."""
        return self.embed_tokens(token_ids).unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()

    def forward(self, batch: ForwardBatch, layout: StepLayout) -> torch.Tensor:
        """The last layer's streams [T, n, D] for the batch's tokens, every layer's state in `layout`."""
        streams = self.embed(batch.token_ids)
        for i, layer in enumerate(self.layers):
            streams = layer(streams, layout.layer(i), batch.token_ids)
        return streams

    def final_hidden(self, streams: torch.Tensor) -> torch.Tensor:
        return self.hc_head.norm(streams, self.norm.weight, self.cfg.rms_norm_eps)


class DeepseekV4ForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: Backend):
        super().__init__()
        self.cfg, self.backend = cfg, backend
        self.model = DeepseekV4Body(cfg, backend)
        self.lm_head = linear(backend, cfg.hidden_size, cfg.vocab_size)
        self.mtp = nn.ModuleList(MTPBlock(cfg, backend) for _ in range(cfg.num_nextn_predict_layers))
        self._head_fp32: tuple[tuple, torch.Tensor] | None = None  # (weight identity, fp32 copy), see `logits`
        # the backend's own run of the decoder stack and final head (`FusedOps.decoder_stack`), or None
        self._fused_stack = backend.decoder_stack()

    #: the state owners' names, as `SequenceState` holds them: the backbone, and the MTP blocks (the drafter's)
    main_state_owner = "layers"
    default_state_owners = ("layers",)

    def state_owners(self) -> dict[str, list[LayerStateSpec]]:
        """What each state owner keeps per sequence, one spec per layer (for a cache to allocate): the backbone
        layers (`layers`) and the MTP blocks (`mtp_layers`, allocated when a proposer drafts with them)."""
        return {"layers": [layer.state_spec() for layer in self.model.layers],
                "mtp_layers": [block.state_spec() for block in self.mtp]}

    def sequence_state(self, states: dict[str, list[AttentionState]], num_tokens: int = 0) -> SequenceState:
        """One sequence's `SequenceState` from its owners' layer states, every owner at `num_tokens`."""
        return SequenceState(layers=states["layers"], mtp_layers=states.get("mtp_layers", []),
                             num_tokens=num_tokens, mtp_num_tokens=num_tokens)

    def make_state(self, dtype: torch.dtype | None = None, device=None) -> SequenceState:
        """A fresh self-contained state for one sequence (contiguous storage, no paging), every owner's."""
        dtype = dtype or self.lm_head.weight.dtype
        device = device or self.lm_head.weight.device
        return self.sequence_state({owner: [contiguous_state(spec, dtype, device) for spec in specs]
                                    for owner, specs in self.state_owners().items()})

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head in fp32, as the official reference computes it. A backend that multiplies a low-precision
        head with fp32 accumulation and output (`Backend.linear_fp32`) reads it as it is; else it is upcast once
        and kept (re-made only if the weight changes): upcasting it every step cost more than the whole batch-1
        decode floor on the H200 (bench/investigations/gpu_notes.md)."""
        weight = self.lm_head.weight
        if weight.dtype != torch.float32 and not (torch.is_grad_enabled() and weight.requires_grad):
            direct = self.backend.linear_fp32(hidden, weight)  # fp32 out of the low-precision head, if it can
            if direct is not None:
                return direct
            key = (weight.data_ptr(), weight._version, weight.device)
            if self._head_fp32 is None or self._head_fp32[0] != key:
                self._head_fp32 = (key, weight.detach().float())
            weight = self._head_fp32[1]
        return self.backend.linear(hidden.float(), weight)

    def share_projection_inputs(self) -> int:
        """Stack the projections that read the same input into one GEMM each (`common.SharedInput`): every
        attention layer's projections of its normed input, every shared expert's gate and up. Call once the
        weights are in. Returns how many groups were made."""
        groups = [g for m in self.modules() if isinstance(m, (Attention, SharedExpert))
                  for g in share_inputs(self.backend, m.input_projections())]
        return len(groups)

    def forward(self, batch: ForwardBatch, states: Sequence[SequenceState] = (),
                layout: StepLayout | None = None) -> ForwardOutput:
        """Run the new tokens of every sequence, update their states in place, return logits for
        `batch.logits_indices`. The layout follows from the states (`layouts.layout_for`: paged cache states
        take the paged layout, a sequence's own states the contiguous one) unless the caller gives one (a static
        decode step: its caller keeps the states and passes none)."""
        if layout is None:
            check_states(batch, states)
            layout = layout_for(batch, [s.layers for s in states], self.backend, self.model.embed_tokens.weight.dtype)
        rows = None if layout.every_row_logits else batch.logits_indices  # a static step: every row, in order
        if self._fused_stack is not None:
            streams, hidden = self._fused_stack(self.model, batch, layout, rows)
        else:
            streams = self.model(batch, layout)
            hidden = self.model.final_hidden(streams if rows is None else streams[rows])
        for chunk, state in zip(batch.chunks, states):
            state.num_tokens = chunk.end
        return ForwardOutput(streams=streams, logits=self.logits(hidden))

    def mtp_forward(
        self, depth: int, batch: ForwardBatch, states: Sequence[SequenceState], prev_streams: torch.Tensor,
        layout: StepLayout | None = None,
    ) -> ForwardOutput:
        """Run MTP block `depth` (V3 alignment, see `MTPBlock`): row i of the batch carries the main model's
        streams at position p_i (`prev_streams`) and the token at p_i + 1 (`batch.token_ids`), at position p_i;
        its logits predict the token at p_i + 2. A caller's static `layout` (over the block's pools alone: the
        draft chain's CUDA graphs, `draft_graphs`) replaces the states' layout; the caller then keeps the MTP
        token counts, and every row is a logits row."""
        for i, (chunk, state) in enumerate(zip(batch.chunks, states)):
            if chunk.start != state.mtp_num_tokens:
                raise ValueError(f"sequence {i}: MTP chunk starts at {chunk.start}, MTP state holds {state.mtp_num_tokens}")
        block = self.mtp[depth]
        embeds = self.model.embed_tokens(batch.token_ids)
        if layout is None:
            layout = layout_for(batch, [[s.mtp_layers[depth]] for s in states], self.backend, embeds.dtype)
        streams = block(embeds, prev_streams, layout.layer(0), batch.token_ids)
        hidden = block.final_hidden(streams[batch.logits_indices])
        if depth == len(self.mtp) - 1:
            for chunk, state in zip(batch.chunks, states):
                state.mtp_num_tokens = chunk.end
        return ForwardOutput(streams=streams, logits=self.logits(hidden), hidden=hidden)
