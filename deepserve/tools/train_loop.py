"""Training of the embedded model: deepserve's own V4 modules hold the parameters (so the checkpoint has the
engine's canonical names), `train_forward` runs them batched over [B, L] for speed.

Losses, as DeepSeek trains V3/V4:
- next-token cross-entropy of the main model;
- the MTP block's next-next-token cross-entropy (V3 alignment: streams `H_i` with `Emb(t_{i+1})` predict
  `t_{i+2}`), weighted `mtp_weight`; a second pass feeds the block its own output streams, as a chained drafter
  does at inference, weighted `chain_weight`;
- the lightning indexer's distillation loss (DeepSeek-V3.2's DSA recipe): KL from the attention's mass on each
  compressed row to the indexer's softmax over the rows. The first `dense_share` of the steps attend to every
  compressed row (dense warm-up), the rest use the indexer's real top-k;
- no auxiliary balance loss: the routers' selection bias is nudged towards balance after every step
  (auxiliary-loss-free balancing). The hash-routed layers' table is balanced by token frequency up front.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from deepserve.backends.reference import ReferenceBackend
from deepserve.core.config import ModelConfig
from deepserve.model.deepseek_v4 import DeepseekV4ForCausalLM
from deepserve.model.factory import build_model
from deepserve.model.moe import Router

from .train_corpus import BOS
from .train_forward import Pass, main_forward, mtp_forward


@dataclass(frozen=True, slots=True)
class TrainConfig:
    seq_len: int = 256
    tokens_per_step: int = 4096
    lr: float = 4e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    mtp_weight: float = 0.3
    chain_weight: float = 0.15
    mtp_stride: int = 2
    indexer_weight: float = 0.1
    chat_share: float = 0.25
    function_share: float = 0.0  # of the sequences: packed `BOS function EOS` records (`train_corpus` functions)
    dense_share: float = 0.5
    bias_update: float = 1e-2
    #: run the forward under bf16 autocast on a GPU (fp32 master weights and optimizer; the losses and the
    #: softmaxes stay fp32): the H200's matmuls at bf16 speed
    bf16: bool = False
    seed: int = 0


# -- initialisation ----------------------------------------------------------------------------------------------
@torch.no_grad()
def init_weights(model: DeepseekV4ForCausalLM, token_counts: np.ndarray, seed: int) -> None:
    """A trainable starting point: small normal linears (residual outputs scaled down by depth), unit norms,
    near-identity mHC mixing with random biases to break the symmetry of the n identical input streams, and
    frequency-balanced hash-routing tables."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.cfg
    depth_scale = 1.0 / math.sqrt(2 * (cfg.num_hidden_layers + cfg.num_nextn_predict_layers))
    n = cfg.hc_mult
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        shape = p.shape
        if name.endswith("norm.weight"):
            val = torch.ones(shape)
        elif leaf in ("sinks", "position_bias"):
            val = torch.zeros(shape)
        elif leaf in ("fn", "hc_fn"):
            val = torch.randn(shape, generator=g) / math.sqrt(shape[-1])
        elif leaf == "scale" or leaf == "hc_scale":
            val = torch.full(shape, 0.1)
        elif leaf == "base":
            val = 0.5 * torch.randn(shape, generator=g)
            val[2 * n :] = (2.0 * torch.eye(n)).flatten() + 0.1 * torch.randn(n * n, generator=g)
        elif leaf == "hc_base":
            val = torch.zeros(shape)
        elif name.endswith("embed_tokens.weight"):
            val = torch.randn(shape, generator=g)
        else:
            std = 0.02
            if any(s in name for s in ("o_b_proj", "down_proj")):
                std *= depth_scale
            val = std * torch.randn(shape, generator=g)
        p.copy_(val.to(p.dtype))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.zero_()
        elif name.endswith("tid2eid"):
            b.copy_(balanced_hash_table(token_counts, cfg.n_routed_experts, cfg.num_experts_per_tok, seed))


def balanced_hash_table(token_counts: np.ndarray, num_experts: int, k: int, seed: int) -> torch.Tensor:
    """`tid2eid`: k distinct experts per token id, assigned greedily (most frequent token first, to the least
    loaded experts) so that every expert of a hash layer sees about the same number of training tokens."""
    rng = np.random.default_rng(seed)
    load = np.zeros(num_experts)
    table = np.zeros((len(token_counts), k), dtype=np.int64)
    for tok in np.argsort(-token_counts, kind="stable"):
        tiebreak = rng.permutation(num_experts)
        chosen = tiebreak[np.argsort(load[tiebreak], kind="stable")[:k]]
        table[tok] = np.sort(chosen)
        load[chosen] += token_counts[tok] + 1e-3
    return torch.from_numpy(table)


# -- data --------------------------------------------------------------------------------------------------------
class Sampler:
    """Reproducible training sequences of `seq_len + 1` tokens with a loss mask over their targets.

    Code: a window of the concatenated training files, BOS-prefixed when it starts inside a file (a tenth of
    them start at a file's beginning). Functions: whole documented functions of the training files (each
    dedented to its `def` line, as `BOS function EOS`) packed back to back from a random one, loss on every
    token. Chat: rendered examples packed back to back, loss on the answers only.
    """

    def __init__(self, data: dict[str, np.ndarray], cfg: TrainConfig) -> None:
        self.code = data["code"].astype(np.int64)
        self.doc_starts = data["code_doc_starts"].astype(np.int64)
        self.chat = data["chat"].astype(np.int64)
        self.chat_mask = data["chat_mask"].astype(bool)
        self.chat_starts = data["chat_starts"].astype(np.int64)
        self.functions = data["functions"].astype(np.int64) if "functions" in data else np.zeros(0, np.int64)
        self.function_starts = np.append(data["function_starts"], len(self.functions)).astype(np.int64) \
            if "function_starts" in data else np.zeros(1, np.int64)
        if cfg.function_share and len(self.function_starts) < 2:
            raise ValueError(f"function_share {cfg.function_share} but the data holds no functions (prepare it again)")
        if not 0 <= cfg.chat_share + cfg.function_share <= 1:
            raise ValueError(f"chat_share + function_share must lie in [0, 1], got {cfg.chat_share} + "
                             f"{cfg.function_share}")
        self.L = cfg.seq_len
        per_step = cfg.tokens_per_step // cfg.seq_len
        self.num_chat = round(per_step * cfg.chat_share)
        self.num_functions = round(per_step * cfg.function_share)
        self.num_code = per_step - self.num_chat - self.num_functions
        self.rng = np.random.default_rng(cfg.seed)

    def code_window(self) -> tuple[np.ndarray, np.ndarray]:
        L = self.L
        if self.rng.random() < 0.1:
            start = int(self.rng.choice(self.doc_starts[self.doc_starts < len(self.code) - L - 1]))
        else:
            start = int(self.rng.integers(0, len(self.code) - L - 1))
        seq = self.code[start : start + L + 1]
        if seq[0] != BOS:
            seq = np.concatenate(([BOS], seq[:-1]))
        return seq, np.ones(L, dtype=bool)

    def chat_pack(self) -> tuple[np.ndarray, np.ndarray]:
        ids, mask, n = [], [], 0
        while n < self.L + 1:
            i = int(self.rng.integers(0, len(self.chat_starts) - 1))
            a, b = self.chat_starts[i], self.chat_starts[i + 1]
            ids.append(self.chat[a:b])
            mask.append(self.chat_mask[a:b])
            n += b - a
        seq, m = np.concatenate(ids)[: self.L + 1], np.concatenate(mask)[: self.L + 1]
        return seq, m[1:]  # mask[j]: whether target seq[j + 1] counts

    def function_pack(self) -> tuple[np.ndarray, np.ndarray]:
        starts = self.function_starts
        first = int(self.rng.integers(0, len(starts) - 1))
        end = int(np.searchsorted(starts, starts[first] + self.L + 1))  # records until the window is full
        seq = self.functions[starts[first] : starts[min(end, len(starts) - 1)]][: self.L + 1]
        if len(seq) < self.L + 1:  # the stream's last records: wrap around to its first ones
            seq = np.concatenate((seq, self.functions[: self.L + 1 - len(seq)]))
        return seq, np.ones(self.L, dtype=bool)

    def batch(self) -> list[tuple[np.ndarray, np.ndarray]]:
        return [self.code_window() for _ in range(self.num_code)] \
            + [self.function_pack() for _ in range(self.num_functions)] + [self.chat_pack() for _ in range(self.num_chat)]


# -- one step ----------------------------------------------------------------------------------------------------
def masked_ce(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    loss = F.cross_entropy(logits, targets, reduction="none")
    return (loss * mask).sum() / mask.sum().clamp(min=1)


def step_losses(model: DeepseekV4ForCausalLM, seqs, device, dense: bool, mtp_stride: int = 1,
                mtp_offset: int = 0) -> dict[str, torch.Tensor]:
    """All training losses of one batch of equal-length sequences (each from position 0). The MTP block runs on
    every position; its two losses are taken on every `mtp_stride`-th one (the LM head is the costly part)."""
    L = len(seqs[0][0]) - 1
    n = len(seqs)
    ids = torch.tensor(np.stack([s for s, _ in seqs]), dtype=torch.long, device=device)  # [n, L+1]
    mask = torch.tensor(np.stack([m for _, m in seqs]), dtype=torch.float32, device=device)  # [n, L]
    p = Pass(n, L, torch.arange(L, device=device).repeat(n), dense=dense)
    H, logits = main_forward(model, ids[:, :-1], p)
    losses = {"main": masked_ce(logits, ids[:, 1:].reshape(-1), mask.reshape(-1))}
    if p.indexer_losses:
        losses["indexer"] = torch.stack(p.indexer_losses).mean()
    if model.mtp:
        H = H.view(n, L, *H.shape[1:])
        pm = Pass(n, L - 1, torch.arange(L - 1, device=device).repeat(n))
        rows = torch.arange(mtp_offset % mtp_stride, n * (L - 1), mtp_stride, device=device)
        targets, mtp_mask = ids[:, 2:].reshape(-1)[rows], mask[:, 1:].reshape(-1)[rows]
        S, first = mtp_forward(model, ids[:, 1:-1], H[:, :-1].reshape(-1, *H.shape[2:]), pm, rows)
        losses["mtp"] = masked_ce(first, targets, mtp_mask)
        # the chained drafter's view: the block's own output streams at i-1 stand in for the main model's at i
        S = S.view(n, L - 1, *H.shape[2:])
        chained_prev = torch.cat((H[:, :1], S[:, :-1]), dim=1).reshape(-1, *H.shape[2:])
        _, chained = mtp_forward(model, ids[:, 1:-1], chained_prev, pm, rows)
        losses["chain"] = masked_ce(chained, targets, mtp_mask)
    return losses


# -- the loop ----------------------------------------------------------------------------------------------------
def param_groups(model: DeepseekV4ForCausalLM, weight_decay: float):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.dim() >= 2 and "embed_tokens" not in name and not name.endswith(("hc_fn", ".fn")):
            decay.append(p)
        else:
            no_decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class RouterBalancer:
    """Auxiliary-loss-free balancing: after each step, raise the selection bias of under-used experts and lower
    that of over-used ones by a fixed amount."""

    def __init__(self, model: DeepseekV4ForCausalLM, rate: float) -> None:
        self.rate = rate
        self.routers = [m for m in model.modules() if isinstance(m, Router) and not m.is_hash]
        self.counts = {id(r): None for r in self.routers}
        for r in self.routers:
            r.register_forward_hook(self._count)

    def _count(self, module, inputs, output) -> None:
        if not torch.is_grad_enabled():
            return
        ids = output[0]
        c = torch.bincount(ids.reshape(-1), minlength=module.e_score_correction_bias.shape[0]).float()
        prev = self.counts[id(module)]
        self.counts[id(module)] = c if prev is None else prev + c

    @torch.no_grad()
    def update(self) -> float:
        """Apply the bias update; return the worst max/mean load ratio seen this step."""
        worst: torch.Tensor | float = 1.0
        for r in self.routers:
            c = self.counts[id(r)]
            if c is None:
                continue
            r.e_score_correction_bias += self.rate * torch.sign(c.mean() - c)
            worst = torch.maximum(torch.as_tensor(worst, device=c.device), c.max() / c.mean().clamp(min=1))
            self.counts[id(r)] = None
        return worst  # a tensor on the routers' device (read it on the host only when logging: no sync per step)


def build_trainable(model_cfg: ModelConfig, device: str, token_counts: np.ndarray, seed: int):
    model = build_model(model_cfg, ReferenceBackend(device, exact=False), torch.float32)
    init_weights(model, token_counts, seed)
    model.train().requires_grad_(True)
    return model


def train(
    model: DeepseekV4ForCausalLM,
    sampler: Sampler,
    cfg: TrainConfig,
    steps: int | None,
    time_budget_s: float | None,
    log: Callable[[str], None],
    progress: bool = True,
) -> dict:
    """Run the loop. `steps=None` measures the first `warmup_steps // 2` steps and fixes the total so that the
    run fits `time_budget_s` (the schedule only depends on the total after warm-up, so re-running with the
    printed step count reproduces the run). Stops early, keeping the weights, if the budget runs out."""
    from tqdm import tqdm

    device = model.backend.device
    cuda = device.startswith("cuda")
    # the fused AdamW (one kernel for every parameter) on a GPU; autocast only there too
    opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8,
                            fused=True if cuda else None)

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=cfg.bf16 and cuda)

    balancer = RouterBalancer(model, cfg.bias_update)
    calibrate = cfg.warmup_steps // 2 if steps is None else 0
    total = steps or 10**9
    t0 = time.time()
    t_mark = t0
    history, tokens = [], 0
    bar = tqdm(total=steps, desc="train", unit="step", disable=not progress, mininterval=2.0)
    step = 0
    while step < total:
        if calibrate and step == 5:
            t_mark = time.time()  # the first steps pay for start-up (allocator, kernels): time the next ones
        if calibrate and step == calibrate:
            per_step = (time.time() - t_mark) / (calibrate - 5)
            total = max(calibrate + 1, int((time_budget_s - (time.time() - t0)) / per_step) + calibrate)
            log(f"calibrated: {per_step:.3f} s/step -> {total} steps in {time_budget_s:.0f} s "
                f"(repeat with --steps {total})")
            bar.total = total
            bar.refresh()
        dense = step < cfg.dense_share * total
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total, cfg)
        seqs = sampler.batch()
        try:
            with autocast():
                losses = step_losses(model, seqs, device, dense, cfg.mtp_stride, step)
                loss = losses["main"] + cfg.mtp_weight * losses.get("mtp", 0) \
                    + cfg.chain_weight * losses.get("chain", 0) + cfg.indexer_weight * losses.get("indexer", 0)
            opt.zero_grad(set_to_none=True)
            loss.backward()
        except torch.OutOfMemoryError:
            if step > 0 or len(seqs) <= 3:
                raise
            losses = loss = None
            opt.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            sampler.num_code, sampler.num_chat = max(1, sampler.num_code // 2), max(1, sampler.num_chat // 2)
            sampler.num_functions = (sampler.num_functions + 1) // 2
            log(f"out of memory: {len(seqs)} sequences per step is too many; now "
                f"{sampler.num_code + sampler.num_functions + sampler.num_chat}")
            continue
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        imbalance = balancer.update()
        tokens += sum(len(m) for _, m in seqs)
        step += 1
        bar.update(1)
        if step % 25 == 0 or step == total:
            vals = {k: float(v.detach()) for k, v in losses.items()}
            elapsed = time.time() - t0
            row = dict(step=step, lr=lr_at(step - 1, total, cfg), gnorm=float(gnorm), imbalance=float(imbalance),
                       dense=dense, elapsed_s=round(elapsed, 1), tok_per_s=round(tokens / elapsed), **vals)
            history.append(row)
            bar.set_postfix(main=f"{vals['main']:.3f}", mtp=f"{vals.get('mtp', 0):.3f}")
            log(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
        if time_budget_s is not None and time.time() - t0 > time_budget_s * (1.15 if steps is None else 1.0):
            log(f"time budget reached at step {step} of {total}")
            break
    bar.close()
    model.eval().requires_grad_(False)
    return dict(steps_done=step, steps_planned=total, seconds=time.time() - t0, tokens=tokens, history=history)
