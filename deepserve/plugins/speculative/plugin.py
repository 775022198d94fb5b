"""The built-in speculative-decoding methods, contributed through `deepserve_register_proposers`.

- `mtp`: the model's MTP block chained k times; every draft is verified (fixed k).
- `dspark`: on a V4.1 checkpoint its own DSpark drafter (`dspark_v41.py`); on V4 the same drafts as `mtp`, each
  with a confidence (the head shipped beside the checkpoint as `confidence_head.safetensors`, else the draft's
  top-1 probability); either way DSpark's planner chooses how many of each sequence's drafts to verify from
  those confidences and the measured step-time curve.

A factory is called once at start-up as `factory(model=..., config=..., model_dir=...)` with the loaded
`DeepseekV4ForCausalLM`, the `SpeculativeConfig` and the checkpoint directory, and returns a
`deepserve.model.speculative.Proposer`.
"""

from __future__ import annotations

from deepserve.core.hookspecs import Register, hookimpl


def make_mtp(model, config, model_dir=None):
    from deepserve.plugins.speculative.mtp import MTPProposer

    if hasattr(model, "dspark_draft"):
        raise ValueError("a V4.1 checkpoint drafts with DSpark, not MTP: use speculative_config method 'dspark'")
    return MTPProposer(model, config.num_speculative_tokens)


def make_dspark(model, config, model_dir=None):
    from deepserve.model.confidence import ConfidenceHead
    from deepserve.plugins.speculative.dspark import DSparkPlanner
    from deepserve.plugins.speculative.mtp import MTPProposer

    if hasattr(model, "dspark_draft"):  # V4.1: its own drafter (5 drafts a pass, Markov and confidence heads)
        from deepserve.plugins.speculative.dspark_v41 import V41DSparkProposer

        return V41DSparkProposer(model, config.num_speculative_tokens, planner=DSparkPlanner())
    device = model.lm_head.weight.device
    head = ConfidenceHead.from_model_dir(model_dir, model.cfg.hidden_size, device) if model_dir else None
    return MTPProposer(model, config.num_speculative_tokens, confidence_head=head, planner=DSparkPlanner(),
                       with_confidences=True)


@hookimpl
def deepserve_register_proposers(register: Register) -> None:
    register("mtp", make_mtp)
    register("dspark", make_dspark)
