"""Speculative decoding is a plugin contract: a third-party drafter (prompt lookup, n-gram matching over the
sequence's own tokens, no model state) installed through a real `deepserve` entry point plugs in with a
`Proposer` and `deepserve_register_proposers` alone, nothing in deepserve touched, and keeps greedy tokens
exactly while its drafts are accepted."""

from __future__ import annotations

import importlib
import sys
import textwrap

import pytest

from deepserve import LLM, SamplingParams

NGRAM_PLUGIN = '''
    import torch

    from deepserve.core.hookspecs import hookimpl
    from deepserve.model.speculative import Drafts, Proposer


    class PromptLookup(Proposer):
        """Drafts the k tokens that followed the last earlier occurrence of the sequence's final n-gram."""

        def __init__(self, k, device):
            self.num_speculative_tokens, self.device = k, device
            self.history = {}  # id(sequence state) -> its tokens from position 1 on

        def _draft(self, tokens, k):
            for n in (3, 2, 1):
                tail = tokens[-n:]
                for at in range(len(tokens) - n - 1, -1, -1):
                    if tokens[at : at + n] == tail:
                        follow = tokens[at + n : at + n + k]
                        return (follow + [follow[-1]] * k)[:k]
            return [tokens[-1]] * k

        def propose(self, streams, chunks, sampling):
            drafts = []
            for chunk in chunks:
                kept = self.history.get(id(chunk.state), [])[: chunk.start]  # a rollback truncates it
                kept += chunk.next_token_ids
                self.history[id(chunk.state)] = kept
                if chunk.num_drafts:
                    drafts.append(self._draft(kept, chunk.num_drafts))
            if not drafts:
                return None
            return Drafts(torch.tensor(drafts, dtype=torch.long, device=self.device), probs=None)


    @hookimpl
    def deepserve_register_proposers(register):
        register("prompt-lookup", lambda model, config, model_dir=None: PromptLookup(
            config.num_speculative_tokens, model.lm_head.weight.device))
'''


@pytest.fixture
def ngram_plugin(tmp_path, monkeypatch):
    """The drafter as an installed distribution with a `deepserve` entry point (the layout pip makes)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("DEEPSERVE_PLUGINS", raising=False)
    info = tmp_path / "deepserve_prompt_lookup-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: deepserve-prompt-lookup\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[deepserve]\nprompt-lookup = deepserve_prompt_lookup\n")
    (tmp_path / "deepserve_prompt_lookup.py").write_text(textwrap.dedent(NGRAM_PLUGIN))
    importlib.invalidate_caches()
    yield
    sys.modules.pop("deepserve_prompt_lookup", None)


def test_a_third_party_drafter_keeps_greedy_tokens_and_gets_drafts_accepted(ngram_plugin):
    options = dict(accelerator="cpu", block_size=128, kv_cache_bytes=2**24, max_num_seqs=4)  # the embedded model
    plain = LLM(**options)
    lookup = LLM(speculative_config={"method": "prompt-lookup", "num_speculative_tokens": 3}, **options)
    assert lookup.cache.pools.keys() == {"layers"}  # it declares no model state: none is allocated for it
    prompts = ["def add(a, b):\n    return a + b\n\n\n" * 4 + "def add(a, b):\n", "for i in range(10):\n    print(i)\n" * 3]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = plain.generate(prompts, params, use_tqdm=False)
    out = lookup.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    assert sum(o.num_accepted_tokens for o in out) > 0
    assert all(o.num_accepted_tokens <= o.num_verified_tokens <= o.num_draft_tokens for o in out)
    assert lookup.runner.speculation.num_requests_held == 0
