"""The embedded model v2's training pieces (deepserve/tools/train_v2.py, train_sources.py, train_eval.py): licence
checks per package and per file, the issue's "completion parses" rule, sharded checkpoints, and the batched
evaluation path against deepserve's inference path."""

from __future__ import annotations

import email.message
import random

import pytest
import torch

from deepserve.tools import train_sources as ts
from deepserve.tools.train_corpus import SourceFile, summary_clause
from deepserve.tools.train_eval import completion_parses, fenced_code_parses, function_end

torch.set_num_threads(1)


# -- licences ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("expr, permissive", [
    ("MIT", True),
    ("BSD-3-Clause AND 0BSD AND MIT AND Zlib AND CC0-1.0", True),
    ("Apache-2.0 AND Apache-2.0 WITH LLVM-exception AND BSD-2-Clause", True),
    ("Apache-2.0 OR BSD-2-Clause", True),
    ("MPL-2.0 AND MIT", False),
    ("GPL-3.0-or-later OR MIT", True),  # an alternative is enough
    ("(MIT OR GPL-2.0) AND LGPL-2.1", False),
    ("GPL-2.0-only", False),
])
def test_licence_expressions(expr, permissive):
    assert ts.expression_is_permissive(expr) is permissive


@pytest.mark.parametrize("bad", ["", "MIT AND", "(MIT", "MIT )"])
def test_unreadable_expressions_are_refused(bad):
    with pytest.raises(ValueError):
        ts.expression_is_permissive(bad)


def _meta(**fields) -> email.message.Message:
    m = email.message.Message()
    for key, value in fields.items():
        for v in value if isinstance(value, list) else [value]:
            m[key.replace("_", "-")] = v
    return m


def test_package_licence_reads_expression_then_field_then_classifiers():
    assert ts.package_licence(_meta(License_Expression="BSD-3-Clause")).permissive
    lic = ts.package_licence(_meta(License="Apache 2.0"))
    assert (lic.spdx, lic.permissive, lic.evidence) == ("Apache-2.0", True, "License")
    text = "Copyright (c) 2020\n\nPermission is hereby granted, free of charge, to any person obtaining a copy ..."
    assert ts.package_licence(_meta(License=text)).spdx == "MIT"
    lic = ts.package_licence(_meta(Classifier=["License :: OSI Approved :: BSD License"]))
    assert lic.permissive and lic.evidence == "classifiers"
    mixed = ["License :: OSI Approved :: MIT License", "License :: OSI Approved :: GNU General Public License v3 (GPLv3)"]
    assert not ts.package_licence(_meta(Classifier=mixed)).permissive
    assert not ts.package_licence(_meta(License="MPL-2.0")).permissive
    assert ts.package_licence(_meta()).spdx is None and not ts.package_licence(_meta()).permissive


def test_file_headers():
    assert ts.header_licence("# SPDX-License-Identifier: GPL-2.0\nx = 1\n") == (False, "SPDX GPL-2.0")
    assert ts.header_licence("# SPDX-License-Identifier: MIT\nx = 1\n")[0] is True
    assert ts.header_licence('"""Licensed under the GNU General Public License."""\n')[0] is False
    assert ts.header_licence("import matplotlib as mpl\n")[0] is None  # 'mpl' is no MPL
    assert ts.header_licence("x = 1\n") == (None, "")


def test_vendored_files_need_their_own_licence(tmp_path):
    (tmp_path / "pkg" / "_vendor" / "lib").mkdir(parents=True)
    (tmp_path / "pkg" / "_vendor" / "other").mkdir(parents=True)
    (tmp_path / "pkg" / "own.py").write_text("def f():\n    return 1\n")
    (tmp_path / "pkg" / "_vendor" / "lib" / "a.py").write_text("def g():\n    return 2\n")
    (tmp_path / "pkg" / "_vendor" / "lib" / "LICENSE").write_text(
        "Permission is hereby granted, free of charge, to any person obtaining a copy of this software")
    (tmp_path / "pkg" / "_vendor" / "other" / "b.py").write_text("def h():\n    return 3\n")
    (tmp_path / "pkg" / "gpl.py").write_text("# This file is under the GNU General Public License\nx = 1\n")
    (tmp_path / "pkg" / "broken.py").write_text("def (:\n")
    check = lambda rel: ts.check_file(tmp_path, rel, "site-packages/", "pkg")  # noqa: E731
    assert check("pkg/own.py").reason == "kept"
    assert check("pkg/_vendor/lib/a.py").reason.startswith("kept (vendored: pkg/_vendor/lib/LICENSE: MIT")
    assert check("pkg/_vendor/other/b.py").text is None
    assert check("pkg/gpl.py").reason.startswith("licence")
    assert check("pkg/broken.py").reason == "does not parse"


def test_collect_files_drops_non_permissive_packages_and_duplicates(tmp_path):
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "m.py").write_text("def same():\n    return 0\n")
        (tmp_path / name / f"{name}.py").write_text(f"def {name}():\n    return '{name}'\n")
    lic = ts.Licence("MIT", True, "test")
    srcs = [ts.Source(n, "1", lic if n != "c" else ts.Licence("GPL-3.0", False, "test"), tmp_path, "site-packages/",
                      [f"{n}/m.py", f"{n}/{n}.py"]) for n in ("a", "b", "c")]
    kept = ts.collect_files(srcs, max_package_bytes=None, log=lambda m: None)
    assert [c.path for c in kept] == ["site-packages/a/a.py", "site-packages/a/m.py", "site-packages/b/b.py"]
    assert srcs[1].stats["dropped: duplicate"] == 1 and srcs[2].stats["dropped: package licence"] == 2


# -- the parse rule ------------------------------------------------------------------------------------
HEADER = 'def add(a, b):\n    """Return a + b."""\n'


def test_completion_up_to_the_function_end_parses():
    assert completion_parses(HEADER, "    return a + b\n\n\ndef other():\n    pass\n", finished=False)
    assert function_end(HEADER, "    x = a\n    return x\nclass Z:\n", False) == "    x = a\n    return x"


def test_trailing_unfinished_line_is_dropped():
    assert completion_parses(HEADER, "    y = a + b\n    return (y +", finished=False)
    assert not completion_parses(HEADER, "    return (a +", finished=False)  # nothing left but the docstring
    assert not completion_parses(HEADER, "    return (a +", finished=True)  # ended there: it does not parse


def test_comments_alone_do_not_count():
    assert not completion_parses(HEADER, "    # TODO\n    # later\n\n", finished=True)
    assert not completion_parses(HEADER, "    return a +\n    b\n", finished=True)


def test_methods_parse_at_their_own_indentation():
    header = '    def size(self):\n        """The size."""\n'
    assert completion_parses(header, "        return len(self.items)\n    def other(self):\n", finished=False)


def test_fenced_code():
    assert fenced_code_parses("Here:\n```python\ndef f(x):\n    return x * 2\n```\n")
    assert not fenced_code_parses("```python\ndef f(x):\n    return x *\n```")
    assert not fenced_code_parses("```python\ndef f(x):\n    return x * 2\n")  # never closed
    assert not fenced_code_parses('```python\n"""only a string"""\n```')


def test_summary_clause():
    assert summary_clause("Return the sum of a and b.") == "returns the sum of a and b."
    assert summary_clause("Copy a file.\n\nMore text.") == "copies a file."
    assert summary_clause("Push the item.") == "pushes the item."
    assert summary_clause("The sum of a and b.") is None
    assert summary_clause("Return x. Then y.") is None


# -- checkpoints and the batched evaluation path ---------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model():
    from deepserve.core.config import ModelConfig
    from deepserve.tools.train_loop import build_trainable
    from deepserve.tools.train_tiny import TINY_CONFIG
    from deepserve.tools.train_v2 import SMOKE_MODEL

    cfg = ModelConfig.from_dict({**TINY_CONFIG, **SMOKE_MODEL, "vocab_size": 300})
    import numpy as np

    model = build_trainable(cfg, "cpu", np.ones(300), seed=0)
    return model


def test_sharded_checkpoint_round_trips(tmp_path, tiny_model):
    from deepserve.backends.reference import ReferenceBackend
    from deepserve.model.factory import build_model, load_model
    from deepserve.model.writer import save_checkpoint
    from deepserve.tools.train_v2 import save_sharded

    shipped = build_model(tiny_model.cfg, ReferenceBackend("cpu"), torch.bfloat16)
    shipped.load_state_dict({k: v.detach() for k, v in tiny_model.state_dict().items()})
    save_checkpoint(shipped, tmp_path)
    total = (tmp_path / "model.safetensors").stat().st_size
    largest = max(t.numel() * t.element_size() for t in shipped.state_dict().values())
    cap = max(total // 3, largest)
    shards = save_sharded(tmp_path, max_bytes=cap)
    assert len(shards) >= 2 and not (tmp_path / "model.safetensors").exists()
    assert all(s.stat().st_size <= cap + 16384 for s in shards)  # + each shard's JSON header
    back = load_model(tmp_path, ReferenceBackend("cpu"), dtype="bfloat16", progress=False)
    for (name, a), (_, b) in zip(sorted(shipped.state_dict().items()), sorted(back.state_dict().items())):
        assert torch.equal(a, b), name


def test_batched_greedy_matches_the_inference_path(tiny_model):
    """The right-padded batched generation (training forward) gives deepserve's varlen greedy tokens."""
    from deepserve.tools.train_eval import batched_greedy, greedy_generate

    rng = random.Random(0)
    prompts = [[0] + [rng.randrange(2, 300) for _ in range(n)] for n in (5, 40, 23)]
    ref = greedy_generate(tiny_model, prompts, 12)
    got = batched_greedy(tiny_model, prompts, 12, eos=1, batch_size=3)
    for r, (g, ended) in zip(ref, got):
        stop = r.index(1) if 1 in r else len(r)
        assert g == r[:stop] and ended == (stop < len(r))


def test_function_headers_come_with_their_docstring():
    from deepserve.tools.train_v2 import function_headers

    text = ('import os\n\n\nclass A:\n    def m(self, x):\n        """Double x.\n\n        More.\n        """\n'
            '        return 2 * x\n\n\ndef only_doc():\n    """Nothing else."""\n\n\ndef f(a):\n    """F."""\n    return a\n')
    heads = function_headers(SourceFile("x.py", text))
    assert [h["qualname"] for h in heads] == ["A.m", "f"]
    assert heads[0]["header"] == 'def m(self, x):\n    """Double x.\n\n    More.\n    """\n'


def test_a_prompt_that_stops_after_the_docstring_quotes():
    """The header prompt ends with the docstring's quotes; the completion's first piece ends that line."""
    header = HEADER.rstrip("\n")
    assert completion_parses(header, "\n    return a + b\n\ndef g():\n", finished=False)
    assert function_end(header, "  # same line\n    return 1\nx = 2\n", False) == "  # same line\n    return 1"
    assert not completion_parses(header, "\n\ndef g():\n    pass\n", finished=False)


def test_incremental_greedy_matches_batched_greedy(tiny_model):
    from deepserve.tools.train_eval import batched_greedy, incremental_greedy

    rng = random.Random(1)
    prompts = [[0] + [rng.randrange(2, 300) for _ in range(n)] for n in (7, 30)]
    stop = lambda i, ids: len(ids) >= 5 + 3 * i  # noqa: E731
    assert incremental_greedy(tiny_model, prompts, 10, eos=1, stop=stop, check_every=2) == \
        batched_greedy(tiny_model, prompts, 10, eos=1, batch_size=2, stop=stop, check_every=2)


# -- the training recipe: the sync-free MoE, the function records, the chat answer's fence ----------------------
def test_the_training_moe_gives_the_sparse_layers_output_and_gradients(tiny_model):
    """`train_forward.moe` runs every expert on every token and weighs them by the routing: the reference
    backend's per-expert loop's output, and the same gradients for every parameter (unchosen experts get none)."""
    from deepserve.tools.train_forward import moe

    mlp = tiny_model.model.layers[1].mlp  # a routed (not hash) layer
    x = torch.randn(37, tiny_model.cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    ids = torch.randint(2, 300, (37,), generator=torch.Generator().manual_seed(4))
    grads = []
    for fn in (lambda: mlp(x, ids), lambda: moe(mlp, x, ids)):
        mlp.zero_grad(set_to_none=True)
        out = fn()
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads.append((out.detach(), {n: p.grad.clone() for n, p in mlp.named_parameters() if p.grad is not None}))
    (ref, ref_g), (got, got_g) = grads
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert ref_g.keys() == got_g.keys() and "experts.gate_up_proj" in got_g
    for name in ref_g:
        torch.testing.assert_close(got_g[name], ref_g[name], atol=1e-5, rtol=1e-5, msg=name)
    mlp.zero_grad(set_to_none=True)


def test_the_sampler_mixes_code_functions_and_chat():
    """Function sequences start at a record's BOS and pack whole `BOS function EOS` records; the step's
    sequences split by the shares; a share without function records in the data is refused."""
    import numpy as np

    from deepserve.tools.train_loop import Sampler, TrainConfig

    rng = np.random.default_rng(0)
    records = [np.concatenate(([0], rng.integers(2, 50, n), [1])) for n in rng.integers(5, 40, 60)]
    data = dict(code=rng.integers(2, 50, 5000), code_doc_starts=np.arange(0, 5000, 500),
                chat=np.concatenate(records), chat_mask=np.ones(sum(map(len, records)), np.uint8),
                chat_starts=np.cumsum([0] + [len(r) for r in records]),
                functions=np.concatenate(records).astype(np.uint16),
                function_starts=np.cumsum([0] + [len(r) for r in records[:-1]]))
    cfg = TrainConfig(seq_len=64, tokens_per_step=64 * 20, chat_share=0.25, function_share=0.3)
    s = Sampler(data, cfg)
    assert (s.num_code, s.num_functions, s.num_chat) == (9, 6, 5)
    batch = s.batch()
    assert len(batch) == 20 and all(len(seq) == 65 and len(m) == 64 for seq, m in batch)
    starts = set(data["function_starts"].tolist())
    stream = data["functions"].astype(np.int64).tolist()
    for seq, mask in batch[9:15]:
        assert seq[0] == 0 and mask.all()
        at = [i for i in starts if stream[i : i + 65] == seq.tolist()[: min(65, len(stream) - i)]]
        assert at, "a function window starts at a record"
    with pytest.raises(ValueError, match="no functions"):
        Sampler({k: v for k, v in data.items() if not k.startswith("function")}, cfg)
    with pytest.raises(ValueError, match="chat_share \\+ function_share"):
        Sampler(data, TrainConfig(chat_share=0.8, function_share=0.3))


def test_the_chat_answers_closing_fence_is_on_its_own_line():
    from deepserve.tools.train_corpus import FunctionPair, chat_text

    pair = FunctionPair("m.py", "add", "(a, b)", "Add two numbers.", 'def add(a, b):\n    """Add."""\n    return a + b')
    answer = chat_text(pair, random.Random(0)).answer
    assert answer == '```python\ndef add(a, b):\n    """Add."""\n    return a + b\n```'
    assert fenced_code_parses(answer)


def test_chat_answers_drop_the_docstring_and_private_or_long_functions():
    from deepserve.tools.train_corpus import FunctionPair, chat_text, short_chat_pairs, without_docstring

    src = '@cache\ndef add(a, b):\n    """Add\n    two numbers."""\n    return a + b'
    assert without_docstring(src) == "@cache\ndef add(a, b):\n    return a + b"
    assert without_docstring('def f():\n    """Only a docstring."""') is None
    assert without_docstring('def f():\n    """Doc."""; return 1') is None  # the docstring shares its line
    pairs = [FunctionPair("m.py", "add", "(a, b)", "Add two numbers.", src),
             FunctionPair("m.py", "_helper", "(a)", "A private helper.", 'def _helper(a):\n    """D."""\n    return a'),
             FunctionPair("m.py", "C.__len__", "(self)", "The length.", 'def __len__(self):\n    """D."""\n    return 0'),
             FunctionPair("m.py", "big", "()", "Big.", 'def big():\n    """D."""\n' + "    x = 1\n" * 100)]
    short = short_chat_pairs(pairs, max_chars=200)
    assert [p.qualname for p in short] == ["add", "C.__len__"]
    answer = chat_text(short[0], random.Random(0)).answer
    assert answer == "```python\n@cache\ndef add(a, b):\n    return a + b\n```" and fenced_code_parses(answer)
