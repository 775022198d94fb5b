"""Structured output's token masks on the device: the host's packed grammar bitmask turned into a logits bias."""

from __future__ import annotations

import functools

import torch

from .batch import to_device


def mask_bias(bitmask: torch.Tensor, vocab_size: int, device: torch.device) -> torch.Tensor:
    """A CPU int32 grammar bitmask [n, ceil(V / 32)] (bit j of word w: token 32w + j allowed) -> fp32 [n, V] on
    `device`: 0 where the token is allowed, -inf where it is forbidden, to add to the logits. Built by a byte
    table lookup, without branches (a masked fill over a patchy mask is several times slower on a CPU). A row
    that allows nothing (a grammar's dead end, whose request the host is finishing) forbids nothing, so its
    discarded sample is still a valid id."""
    inverted = ~bitmask
    inverted[(bitmask == 0).all(dim=1)] = 0
    forbidden_bytes = to_device(inverted.view(torch.uint8), torch.uint8, device).long()  # packed: 32x fewer bytes
    bias = torch.nn.functional.embedding(forbidden_bytes, _byte_bias(device))  # [n, 4 * words, 8]
    return bias.view(bitmask.shape[0], -1)[:, :vocab_size]


@functools.cache
def _byte_bias(device: torch.device) -> torch.Tensor:
    """[256, 8] fp32: row b holds -inf at the set bits of byte b (lowest bit first), 0 elsewhere."""
    bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
    return torch.where(bits.bool(), float("-inf"), 0.0).to(device)
