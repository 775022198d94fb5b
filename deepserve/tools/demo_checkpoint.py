"""Build a small random DeepSeek-V4 checkpoint (every layer type, hash and routed MoE, MTP block, byte-level
tokenizer that also holds the V4 chat special tokens) so the whole path runs on a fresh machine with nothing
downloaded.

The weights are random: the text it writes is noise. It exists to exercise the whole path (loader, model,
sampling, detokenization) until the project's embedded trained model lands.

    python -m deepserve.tools.demo_checkpoint OUT_DIR [--seed N]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from deepserve.backends.reference import ReferenceBackend
from deepserve.core.config import ModelConfig

# Shapes of the demo model; vocab_size is left to the caller (the demo tokenizer decides it).
DEMO_CONFIG = dict(
    model_type="deepseek_v4", hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
    head_dim=32, q_lora_rank=32, partial_rotary_factor=0.5, o_groups=2, o_lora_rank=16, sliding_window=16,
    layer_types=["sliding_attention", "sliding_attention", "compressed_sparse_attention",
                 "heavily_compressed_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    rope_parameters={"rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 4096,
                     "beta_fast": 32, "beta_slow": 1},
    max_position_embeddings=65536, index_n_heads=16, index_head_dim=16, index_topk=4, n_routed_experts=8,
    num_experts_per_tok=2, moe_intermediate_size=32, num_hash_layers=3, num_nextn_predict_layers=1,
    bos_token_id=0, eos_token_id=1,
)


def chat_special_tokens() -> list[str]:
    """Every special token deepseek-recipe renders (User, Assistant, thinking, DSML, ...), BOS/EOS excluded."""
    import deepseek_recipe as dr

    from deepserve.model.tokenizer import BOS_TOKEN, EOS_TOKEN

    tokens = {getattr(dr.SpecialToken, n).default_str() for n in dir(dr.SpecialToken) if n[:1].isupper()}
    return sorted(tokens - {BOS_TOKEN, EOS_TOKEN})


def build_demo_checkpoint(path: str | os.PathLike, seed: int = 0, **overrides) -> Path:
    """Write config.json, model.safetensors and tokenizer.json of a random tiny V4 into `path`. Token ids:
    BOS 0, EOS 1, the chat special tokens, then the 256 bytes. `overrides`: config fields other than
    `DEMO_CONFIG`'s (e.g. fewer layers: `layer_types` and `num_hidden_layers` together)."""
    from deepserve.model.factory import build_model, randomize
    from deepserve.model.tokenizer import make_byte_tokenizer
    from deepserve.model.writer import save_checkpoint

    specials = chat_special_tokens()
    cfg = ModelConfig.from_dict({**DEMO_CONFIG, **overrides, "vocab_size": 2 + len(specials) + 256})
    model = randomize(build_model(cfg, ReferenceBackend("cpu"), torch.float32), seed)
    path = save_checkpoint(model, path)
    make_byte_tokenizer(path, special_tokens=specials)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(build_demo_checkpoint(args.out_dir, args.seed))


if __name__ == "__main__":
    main()
