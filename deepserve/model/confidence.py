"""DSpark's confidence head: the probability that a draft token is accepted, from what the drafter knows.

For draft j of a chain, given that drafts < j were accepted, the head reads features available at draft time:
the MTP block's normed hidden state for that draft (the LM head's input, `ForwardOutput.hidden`), the draft
distribution's top-1 probability, its margin over the second, its entropy, and the draft index j (one-hot).
It is a 2-layer MLP over standardised features, trained on logged accept/reject outcomes
(`deepserve.tools.train_confidence`) and shipped beside the checkpoint as `confidence_head.safetensors` plus a
json of its config. Without a head file, `top1_probability` (the draft's own top-1 probability) stands in.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

HEAD_FILE = "confidence_head.safetensors"
FORMAT = "deepserve-confidence-head/1"
#: draft indices past this share the last one-hot slot
MAX_DRAFTS = 8
#: the scalar features after the hidden state, in order (the one-hot draft index follows them)
SCALARS = ("top1_probability", "top1_margin", "entropy")


def top1_probability(logits: torch.Tensor) -> torch.Tensor:
    """The heuristic confidence: the draft distribution's top-1 probability, [n, V] -> [n]."""
    return torch.softmax(logits.float(), dim=-1).amax(dim=-1)


class ConfidenceHead(nn.Module):
    def __init__(self, hidden_size: int, width: int = 32) -> None:
        super().__init__()
        self.hidden_size, self.width = hidden_size, width
        num_features = self.num_features(hidden_size)
        self.register_buffer("feature_mean", torch.zeros(num_features))
        self.register_buffer("feature_std", torch.ones(num_features))
        self.fc1 = nn.Linear(num_features, width)
        self.fc2 = nn.Linear(width, 1)

    @staticmethod
    def num_features(hidden_size: int) -> int:
        return hidden_size + len(SCALARS) + MAX_DRAFTS

    @staticmethod
    def features(hidden: torch.Tensor, logits: torch.Tensor, draft_index: int) -> torch.Tensor:
        """Features of n drafts at chain position `draft_index` (0 = first draft): hidden [n, H] (the MTP block's
        normed hidden state), logits [n, V] (the draft distribution) -> [n, H + 3 + MAX_DRAFTS], fp32."""
        if hidden.shape[0] != logits.shape[0]:
            raise ValueError(f"{hidden.shape[0]} hidden rows but {logits.shape[0]} logits rows")
        if draft_index < 0:
            raise ValueError(f"draft_index must be >= 0, got {draft_index}")
        logp = torch.log_softmax(logits.float(), dim=-1)
        top2 = logp.topk(2, dim=-1).values.exp()
        entropy = -(logp.exp() * logp).sum(-1)
        onehot = torch.zeros(hidden.shape[0], MAX_DRAFTS, device=hidden.device)
        onehot[:, min(draft_index, MAX_DRAFTS - 1)] = 1.0
        scalars = torch.stack([top2[:, 0], top2[:, 0] - top2[:, 1], entropy], dim=-1)
        return torch.cat([hidden.float(), scalars, onehot], dim=-1)

    def set_standardisation(self, features: torch.Tensor) -> None:
        """Standardise inputs with the training features' statistics (the one-hot slots are left as they are)."""
        mean, std = features.mean(0), features.std(0).clamp_min(1e-4)
        mean[-MAX_DRAFTS:], std[-MAX_DRAFTS:] = 0.0, 1.0
        self.feature_mean.copy_(mean)
        self.feature_std.copy_(std)

    def logit(self, features: torch.Tensor) -> torch.Tensor:
        x = (features.float() - self.feature_mean) / self.feature_std
        return self.fc2(torch.nn.functional.gelu(self.fc1(x))).squeeze(-1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """Acceptance probabilities in (0, 1), [n, F] -> [n]."""
        return torch.sigmoid(self.logit(features))

    def config(self) -> dict:
        return dict(format=FORMAT, hidden_size=self.hidden_size, width=self.width, max_drafts=MAX_DRAFTS,
                    scalars=list(SCALARS))

    def save(self, path: str | os.PathLike) -> None:
        """Weights to `path` (safetensors, fp32) and the config to the same name with `.json`."""
        from safetensors.torch import save_file

        path = Path(path)
        save_file({k: v.detach().float().contiguous().cpu() for k, v in self.state_dict().items()}, str(path))
        path.with_suffix(".json").write_text(json.dumps(self.config(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike, hidden_size: int, device: str | torch.device = "cpu") -> ConfidenceHead:
        from safetensors.torch import load_file

        path = Path(path)
        cfg = json.loads(path.with_suffix(".json").read_text())
        if cfg.get("format") != FORMAT or cfg.get("max_drafts") != MAX_DRAFTS or cfg.get("scalars") != list(SCALARS):
            raise ValueError(f"{path}: not a {FORMAT} head with these features ({cfg})")
        if cfg["hidden_size"] != hidden_size:
            raise ValueError(f"{path} was trained for hidden size {cfg['hidden_size']}, the model has {hidden_size}")
        head = cls(hidden_size, cfg["width"])
        head.load_state_dict(load_file(str(path)))
        return head.to(device).eval().requires_grad_(False)

    @classmethod
    def from_model_dir(cls, model_dir: str | os.PathLike, hidden_size: int,
                       device: str | torch.device = "cpu") -> ConfidenceHead | None:
        """The head shipped beside a checkpoint, or None when there is none (use `top1_probability`)."""
        path = Path(model_dir) / HEAD_FILE
        return cls.load(path, hidden_size, device) if path.is_file() else None


def draft_confidence(head: ConfidenceHead | None, hidden: torch.Tensor, logits: torch.Tensor,
                     draft_index: int) -> torch.Tensor:
    """Acceptance probability of n drafts at chain position `draft_index`: the head's, or the top-1 heuristic."""
    if head is None:
        return top1_probability(logits)
    return head(ConfidenceHead.features(hidden, logits, draft_index))
