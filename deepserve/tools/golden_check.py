"""Check deepserve's V4.1 against a golden directory (../shared/v41-golden-format.md; docs/v41.md).

    python -m deepserve.tools.golden_check tests/golden/v41/tiny_a [--tolerance all|exact] [--json report.json]

Loads `DIR/tiny` with deepserve's V4.1 model (sizes and layer roles from its config) and compares it with the
reference's recorded outputs:
* layer-forced (the sharp checks): every block gets the reference's recorded input (block j the x_out/pre_out of
  block j-1; block 0 the embedding), in the prompt prefill and in each decode step; each block's output is
  compared with the recorded x_out by relative RMS against 2 x the reference's own envelope for that layer
  (`--tolerance all`: every envelope member; `exact`: the tie members, + 1e-3); Engram hash ids must be equal;
  indexer selections and candidate blocks are compared row by row; the final logits, DSpark drafts (where the
  reference's own members agree) and confidence logits come from the same forced run;
* end to end: prompt logprobs, teacher-forced logprobs and decode logprobs within 2 x the envelope (+ a floor),
  greedy tokens only where the reference's members agree, drafts only where they are stable.
Prints one table and exits 1 if any check fails (2 if the directory cannot be read).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

# Used only where a directory carries no envelope of its own: the spreads the golden format reports (§6).
DOC_ENVELOPE = {"exact": {"prefill": 1.3e-2, "decode": 2.7e-2}, "all": {"prefill": 3e-2, "decode": 3e-2},
                "logits": 0.21, "dspark_logits": 0.63, "confidence_logit": 0.07}
LOGPROB_FLOOR = 0.05


@dataclass
class Row:
    check: str
    prompt: int
    value: float
    limit: float
    ok: bool
    note: str = ""


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)

    def add(self, check, prompt, value, limit, ok=None, note=""):
        ok = (value <= limit) if ok is None else ok
        self.rows.append(Row(check, prompt, float(value), float(limit), bool(ok), note))

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)

    def table(self) -> str:
        w = max([len(r.check) for r in self.rows] + [5])
        lines = [f"{'check':<{w}}  p  {'value':>10}  {'limit':>10}  {'ratio':>6}  result  note"]
        for r in self.rows:
            ratio = r.value / r.limit if r.limit > 0 else (0.0 if r.value == 0 else math.inf)
            lines.append(f"{r.check:<{w}}  {r.prompt}  {r.value:>10.4g}  {r.limit:>10.4g}  {ratio:>6.2f}  "
                         f"{'PASS' if r.ok else 'FAIL':<6}  {r.note}")
        n_fail = sum(not r.ok for r in self.rows)
        lines.append(f"{len(self.rows)} checks, {n_fail} failed")
        return "\n".join(lines)


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


def lp(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.double(), dim=-1)


class Golden:
    """A golden directory's files, read once; every size comes from its own config."""

    def __init__(self, root: Path):
        self.root = root
        for f in ("reference.json", "reference_logits.safetensors", "reference_layers.safetensors", "tiny"):
            if not (root / f).exists():
                raise FileNotFoundError(f"{root} is not a golden directory: {f} is missing")
        self.doc = json.loads((root / "reference.json").read_text())
        self.logits = load_file(str(root / "reference_logits.safetensors"))
        self.layers = load_file(str(root / "reference_layers.safetensors"))
        self.gen = int(self.doc.get("gen", 16))
        lf = self.doc.get("layer_forced") or {}
        self.env_layers = {k: lf.get("envelope_" + k) for k in ("all", "exact")}
        self.env_logits = {"all": lf.get("logits_max_abs_all"), "exact": lf.get("logits_max_abs_exact")}
        self.env_scalar = {(k, mode): lf.get(f"{k}_max_abs_{mode}") for k in ("dspark_logits", "confidence_logit")
                           for mode in ("all", "exact")}

    def layer_limit(self, mode: str, kind: str, j: int) -> tuple[float, str]:
        env = self.env_layers.get(mode)
        if isinstance(env, dict) and isinstance(env.get(kind), list) and j < len(env[kind]):
            e = float(env[kind][j])
            return (2 * e + 1e-3 if mode == "exact" else max(2 * e, 1e-3)), ""
        e = DOC_ENVELOPE[mode][kind]
        return 2 * e + (1e-3 if mode == "exact" else 0.0), "doc envelope"

    def logits_limit(self, mode: str) -> tuple[float, str]:
        e = self.env_logits.get(mode)
        if e is None:
            return 2 * DOC_ENVELOPE["logits"], "doc envelope"
        return 2 * float(e) + 1e-3, ""

    def scalar_limit(self, key: str, mode: str) -> tuple[float, str]:
        """DSpark logits / confidence logits: 2 x the directory's forced-run envelope, else the format's."""
        e = self.env_scalar.get((key, mode))
        if e is None:
            return 2 * DOC_ENVELOPE[key], "doc envelope"
        return 2 * float(e) + 1e-3, ""


def forced_run(model, g: Golden, i: int, ref: dict):
    """The layer-forced protocol on prompt i: prefill, then each decode step, every block fed the recorded input;
    DSpark from the taps of the same run. Returns the per-run outputs."""
    n = model.cfg.n_layers
    prompt = ref["prompt"]
    state = model.make_state()

    def inputs(kind: str, rows: slice | None):
        f = {}
        for j in range(1, n):
            x = g.layers[f"p{i}.{kind}.layer{j - 1}.x_out"]
            p = g.layers[f"p{i}.{kind}.layer{j - 1}.pre_out"].float()
            f[j] = (x[rows], p[rows]) if rows is not None else (x, p)
        return f

    pre = model.forward(prompt, state, all_logits=True, forced=inputs("prefill", None))
    if model.cfg.n_mtp_layers and pre.main_hidden is not None:
        model.dspark_seed(pre.main_hidden, state)
    steps = []
    for k, step in enumerate(ref["decode_steps"][: g.gen]):
        out = model.forward([step["input_token"]], state, forced=inputs("decode", slice(k, k + 1)))
        draft = None
        if model.cfg.n_mtp_layers and "dspark" in step:
            draft = model.dspark_draft(int(step["dspark"]["golden"]), out.main_hidden, state)
        steps.append((out, draft))
    return pre, steps


def check_prompt(model, g: Golden, i: int, ref: dict, mode: str, rep: Report, end_to_end: bool = True) -> None:
    c = model.cfg
    n, L, gen = c.n_layers, len(ref["prompt"]), g.gen
    pre, steps = forced_run(model, g, i, ref)

    # Engram row ids, exactly
    for j in c.engram_layer_ids:
        key = f"p{i}.prefill.layer{j}.engram_hash_ids"
        if key in g.layers:
            mine = pre.engram_ids[j].cpu()
            same = mine.shape == g.layers[key].shape and torch.equal(mine, g.layers[key].long())
            rep.add(f"engram ids prefill L{j}", i, 0 if same else 1, 0, same, f"{tuple(mine.shape)}")
        key = f"p{i}.decode.layer{j}.engram_hash_ids"
        if key in g.layers:
            mine = torch.cat([s[0].engram_ids[j].cpu() for s in steps])
            same = mine.shape == g.layers[key].shape and torch.equal(mine, g.layers[key].long())
            rep.add(f"engram ids decode L{j}", i, 0 if same else 1, 0, same)

    # per-block outputs, layer-forced
    for j in range(n):
        lim, note = g.layer_limit(mode, "prefill", j)
        rep.add(f"forced prefill L{j} relRMS", i, rel_rms(pre.x_out[j], g.layers[f"p{i}.prefill.layer{j}.x_out"]),
                lim, note=note)
    for j in range(n):
        lim, note = g.layer_limit(mode, "decode", j)
        mine = torch.cat([s[0].x_out[j] for s in steps])
        rep.add(f"forced decode L{j} relRMS", i, rel_rms(mine, g.layers[f"p{i}.decode.layer{j}.x_out"]), lim,
                note=note)

    # final logits of the forced run (prefill all positions, decode each step)
    lim, note = g.logits_limit(mode)
    d_pre = float((pre.logits - g.logits[f"p{i}.prefill_logits"]).abs().max())
    rep.add("forced prefill logits max|d|", i, d_pre, lim, note=note)
    dec = torch.stack([s[0].logits for s in steps])
    rep.add("forced decode logits max|d|", i, float((dec - g.logits[f"p{i}.decode_logits"]).abs().max()), lim,
            note=note)

    # indexer selections and candidate blocks (prefill), row agreement
    for key, t in sorted(g.logits.items()):
        pref = f"p{i}.prefill_topk_rows.layer"
        if key.startswith(pref):
            j = int(key[len(pref):])
            mine = pre.topk.get(j)
            if mine is None or mine.shape != t.shape:
                rep.add(f"topk rows L{j}", i, 1, 0, False, f"shape {None if mine is None else tuple(mine.shape)} "
                                                             f"vs {tuple(t.shape)}")
                continue
            agree = float((mine.cpu().int() == t.int()).all(-1).float().mean())
            rep.add(f"topk rows L{j} (rows differing)", i, 1 - agree, 0.1, note=f"{agree:.1%} of rows equal")
        pref = f"p{i}.prefill_candidates.layer"
        if key.startswith(pref):
            mine = pre.candidates
            ok = mine is not None and mine.shape == t.shape
            agree = float((mine.cpu() == t.bool()).all(-1).float().mean()) if ok else 0.0
            rep.add(f"candidates L{key[len(pref):]} (rows differing)", i, 1 - agree, 0.1,
                    note=f"{agree:.1%} of rows equal")
    # decode selections
    sel_total = sel_equal = 0
    for k, (out, _) in enumerate(steps):
        rows = ref["decode_steps"][k].get("topk_rows") or {}
        items = rows.items() if isinstance(rows, dict) else zip(c.index_source_layers, rows)
        for j, want in items:
            got = out.topk.get(int(re.sub(r"\D", "", str(j))))  # "6", 6 or "layer6"
            if got is None:
                continue
            sel_total += 1
            sel_equal += int(got[0].tolist() == list(want))
    if sel_total:
        rep.add("decode topk rows (steps differing)", i, 1 - sel_equal / sel_total, 0.1,
                note=f"{sel_equal}/{sel_total} equal")

    # DSpark, from the forced taps
    if c.n_mtp_layers and steps and steps[0][1] is not None:
        env = (g.doc.get("refs")[i].get("envelope") or {})
        stable = env.get("dspark_drafts_stable") or [True] * gen
        want_logits = g.logits.get(f"p{i}.dspark_logits")
        want_conf = g.layers.get(f"p{i}.dspark_confidence_logit")
        bad = [k for k, (_, d) in enumerate(steps)
               if stable[k] and d.tokens != ref["decode_steps"][k]["dspark"]["tokens"]]
        rep.add("dspark drafts (stable steps differing)", i, len(bad), 0, note=f"{sum(stable)} stable steps"
                + (f"; differ at {bad}" if bad else ""))
        if want_logits is not None:
            got = torch.stack([d.logits for _, d in steps])
            lim, note = g.scalar_limit("dspark_logits", mode)
            rep.add("dspark logits max|d|", i, float((got - want_logits).abs().max()), lim, note=note)
        if want_conf is not None:
            got = torch.stack([d.confidence_logit for _, d in steps])
            lim, note = g.scalar_limit("confidence_logit", mode)
            rep.add("dspark confidence logit max|d|", i, float((got - want_conf).abs().max()), lim, note=note)

    if end_to_end:
        check_end_to_end(model, g, i, ref, rep)


def check_end_to_end(model, g: Golden, i: int, ref: dict, rep: Report) -> None:
    """No forcing: prompt logprobs, teacher-forced logprobs, the decode path fed the greedy tokens."""
    L, gen = len(ref["prompt"]), g.gen
    env = ref.get("envelope") or {}
    state = model.make_state()
    e2e = model.forward(ref["prompt"], state, all_logits=True)
    plp = lp(e2e.logits)
    want = ref["prefill"]["next_prompt_token_logprob"]
    tgt_env = env.get("prefill_target_max_abs_dlp")
    worst = 0.0
    for t in range(L - 1):
        lim = 2 * (tgt_env[t] if tgt_env else 0.3) + LOGPROB_FLOOR
        worst = max(worst, abs(float(plp[t, ref["prompt"][t + 1]]) - want[t]) / lim)
    rep.add("e2e prompt logprobs (worst |d|/limit)", i, worst, 1.0,
            note="limit 2 x envelope + 0.05" if tgt_env else "no envelope: 2 x 0.3 + 0.05")
    greedy = ref["greedy"]
    full = lp(model.forward(ref["prompt"] + greedy, model.make_state(), all_logits=True).logits)
    worst = 0.0
    for k in range(gen):
        lim = 2 * (tgt_env[L - 1 + k] if tgt_env and L - 1 + k < len(tgt_env) else 0.3) + LOGPROB_FLOOR
        worst = max(worst, abs(float(full[L - 1 + k, greedy[k]]) - ref["teacher_forced_logprobs"][k]) / lim)
    rep.add("e2e teacher-forced logprobs (worst |d|/limit)", i, worst, 1.0)
    if model.cfg.n_mtp_layers and e2e.main_hidden is not None:
        model.dspark_seed(e2e.main_hidden, state)
    dec_env = env.get("decode_target_max_abs_dlp")
    argmax_stable = env.get("decode_argmax_stable") or [k == 0 for k in range(gen)]
    draft_stable = env.get("dspark_drafts_stable") or [False] * gen
    worst, tok_bad, draft_bad, outs = 0.0, [], [], []
    last = lp(e2e.logits[-1])
    for k in range(gen):
        logp = last if k == 0 else lp(outs[k - 1].logits)
        lim = 2 * (dec_env[k] if dec_env else 0.3) + LOGPROB_FLOOR
        worst = max(worst, abs(float(logp[greedy[k]]) - ref["logprobs"][k]) / lim)
        if argmax_stable[k] and int(logp.argmax()) != greedy[k]:
            tok_bad.append(k)
        o = model.forward([greedy[k]], state)
        outs.append(o)
        if model.cfg.n_mtp_layers and "dspark" in ref["decode_steps"][k]:
            d = model.dspark_draft(int(o.logits.argmax()), o.main_hidden, state)
            if draft_stable[k] and int(o.logits.argmax()) == ref["decode_steps"][k]["argmax"] and \
                    d.tokens != ref["decode_steps"][k]["dspark"]["tokens"]:
                draft_bad.append(k)
    rep.add("e2e decode logprobs (worst |d|/limit)", i, worst, 1.0)
    rep.add("e2e greedy tokens (stable steps differing)", i, len(tok_bad), 0,
            note=f"{sum(argmax_stable)} stable steps" + (f"; differ at {tok_bad}" if tok_bad else ""))
    rep.add("e2e dspark drafts (stable steps differing)", i, len(draft_bad), 0,
            note=f"{sum(draft_stable)} stable steps" + (f"; differ at {draft_bad}" if draft_bad else ""))


def check_config(root: Path, rep: Report) -> None:
    from deepserve.model.v41.config import V41Config

    tiny = root / "tiny"
    hf, ref = tiny / "config.json", tiny / "inference" / "config.json"
    if hf.is_file() and ref.is_file():
        try:
            same = V41Config.from_hf(json.loads(hf.read_text())) == \
                V41Config.from_reference(json.loads(ref.read_text()))
            note = ""
        except ValueError as exc:
            same, note = False, str(exc)[:120]
        rep.add("config: both spellings agree", -1, 0 if same else 1, 0, same, note)


def run(root: Path, mode: str = "all", model=None, prompts=None, end_to_end: bool = True) -> Report:
    """Every check on `root` (or the given prompt indices); `model` replaces the one loaded from root/tiny."""
    from deepserve.model.v41 import load_v41

    g = Golden(root)
    rep = Report()
    check_config(root, rep)
    model = model if model is not None else load_v41(root / "tiny")
    for i, ref in enumerate(g.doc["refs"]):
        if prompts is None or i in prompts:
            check_prompt(model, g, i, ref, mode, rep, end_to_end)
    return rep


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deepserve.tools.golden_check", description=__doc__.split("\n")[0])
    ap.add_argument("directory", type=Path)
    ap.add_argument("--tolerance", choices=("all", "exact"), default="all",
                    help="envelope the layer checks are held to: every member (default) or the tie members")
    ap.add_argument("--json", type=Path, help="also write the rows as JSON here")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    try:
        rep = run(a.directory, a.tolerance)
    except (FileNotFoundError, ValueError, KeyError) as exc:
        print(f"golden_check: cannot check {a.directory}: {exc}", file=sys.stderr)
        return 2
    print(rep.table())
    if a.json:
        a.json.write_text(json.dumps([r.__dict__ for r in rep.rows], indent=1) + "\n")
    return 0 if rep.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
