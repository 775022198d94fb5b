"""Train DSpark's confidence head for a checkpoint with an MTP block (by default the embedded model).

1. Prompts: BOS + `context` tokens of the held-out standard-library files (none of them was trained on; files
   holding a prompt of the checkpoint's heldout.json are left out too, so the tests can measure the head on
   unseen text), half cut at line ends as heldout.json's are, half anywhere. Every other pair of prompts is
   extended by 1-8 tokens sampled from the model at temperature 1, so the logged contexts also hold the model's
   own sampled text.
2. Outcomes: the model continues every prompt greedily (`train_eval.greedy_generate`), so after any prefix of
   the continuation the target's greedy token is the next one. From each position the MTP block drafts a chain
   of k tokens (V3 alignment, as `train_eval.mtp_acceptance` does), feeding itself its own streams and its own
   previous draft; draft j is logged with its features and whether it equals the target's greedy token, as long
   as drafts < j were accepted (acceptance of j is conditional on them).
3. The head (a small MLP, `deepserve.model.confidence`) is fit with AdamW on fp32 CPU tensors from a fixed seed,
   early-stopped on a validation slice of the training prompts, and compared with the top-1-probability
   heuristic on outcomes of separate held-out files: log loss, AUC, Brier score, expected calibration error.

    python -m deepserve.tools.train_confidence --record bench/results/train_confidence_tiny.json
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from deepserve.model.batch import make_batch
from deepserve.model.confidence import HEAD_FILE, MAX_DRAFTS, SCALARS, ConfidenceHead
from deepserve.model.deepseek_v4 import DeepseekV4ForCausalLM

from .train_corpus import BOS, EOS, python_version, stdlib_files
from .train_eval import completion_prompts, greedy_generate

EMBEDDED = Path(__file__).resolve().parents[1] / "assets" / "deepserve-tiny-v4"


@dataclass(frozen=True, slots=True)
class DraftOutcomes:
    """One row per logged draft: its confidence features, whether it was accepted, its chain position."""

    features: torch.Tensor  # [R, F] fp32
    accepted: torch.Tensor  # [R] fp32, 0/1
    draft_index: torch.Tensor  # [R] int64

    @staticmethod
    def cat(parts: Sequence[DraftOutcomes]) -> DraftOutcomes:
        return DraftOutcomes(*(torch.cat([getattr(p, f) for p in parts]) for f in DraftOutcomes.__slots__))

    def __len__(self) -> int:
        return len(self.accepted)

    def top1_probability(self) -> torch.Tensor:
        return self.features[:, -(len(SCALARS) + MAX_DRAFTS)]  # the first scalar after the hidden state


@torch.inference_mode()
def log_draft_outcomes(model: DeepseekV4ForCausalLM, prompts: Sequence[Sequence[int]], num_tokens: int,
                       k: int = 5) -> DraftOutcomes:
    """Greedy-continue every prompt by `num_tokens`, then from each of the first `num_tokens - k` continuation
    positions draft a k-token MTP chain and log each draft until the first rejection (see the module docstring).
    All prompts are drafted together, one varlen batch per chain step."""
    device = model.backend.device
    gens, streams = greedy_generate(model, prompts, num_tokens, keep_streams=True)
    seqs = [list(p) + g for p, g in zip(prompts, gens)]
    lens = [len(p) for p in prompts]
    states = [model.make_state() for _ in prompts]
    # the MTP window over the prompt: row i pairs H_i with token i+1 (teacher-forced, as the engine would)
    model.mtp_forward(0, make_batch([s[1:P] for s, P in zip(seqs, lens)], [0] * len(seqs), device), states,
                      torch.cat([H[: P - 1] for H, P in zip(streams, lens)]))
    feats, labels, index = [], [], []
    for o in range(num_tokens - k):
        pos = [P - 1 + o for P in lens]  # position i: H_i and token i+1 draft token i+2
        out = model.mtp_forward(0, make_batch([[s[i + 1]] for s, i in zip(seqs, pos)], pos, device), states,
                                torch.cat([H[i : i + 1] for H, i in zip(streams, pos)]))
        saved = [(copy.deepcopy(st.mtp_layers), st.mtp_num_tokens) for st in states]
        alive = list(range(len(seqs)))
        for j in range(k):
            drafts = out.logits.argmax(-1).tolist()
            hits = [d == seqs[b][pos[b] + 2 + j] for b, d in zip(alive, drafts)]
            feats.append(ConfidenceHead.features(out.hidden, out.logits, j).cpu())
            labels.extend(hits)
            index.extend([j] * len(alive))
            keep = [r for r, hit in enumerate(hits) if hit]
            if j == k - 1 or not keep:
                break
            prev = out.streams[torch.tensor(keep, device=device)]
            alive = [alive[r] for r in keep]
            # an accepted draft equals the next token of the sequence; it goes in at position i + 1 + j
            batch = make_batch([[seqs[b][pos[b] + 2 + j]] for b in alive], [pos[b] + 1 + j for b in alive], device)
            out = model.mtp_forward(0, batch, [states[b] for b in alive], prev)
        for st, (layers, n) in zip(states, saved):
            st.mtp_layers, st.mtp_num_tokens = layers, n
    return DraftOutcomes(torch.cat(feats), torch.tensor(labels, dtype=torch.float32),
                         torch.tensor(index, dtype=torch.int64))


@torch.inference_mode()
def extend_by_sampling(model: DeepseekV4ForCausalLM, prompts: Sequence[Sequence[int]], num_tokens: Sequence[int],
                       generator: torch.Generator) -> list[list[int]]:
    """Each prompt followed by `num_tokens[i]` tokens sampled from the model at temperature 1 (never EOS)."""
    device = model.backend.device
    states = [model.make_state() for _ in prompts]
    seqs = [list(p) for p in prompts]
    logits = model(make_batch(seqs, [0] * len(seqs), device), states).logits
    for step in range(max(num_tokens)):
        probs = torch.softmax(logits.float().cpu(), -1)
        probs[:, EOS] = 0.0  # keep the text going: outcomes after an end of file say nothing useful
        toks = torch.multinomial(probs, 1, generator=generator)[:, 0].tolist()
        for s, t in zip(seqs, toks):
            s.append(int(t))
        if step + 1 < max(num_tokens):
            logits = model(make_batch([[s[-1]] for s in seqs], [len(s) - 1 for s in seqs], device), states).logits
    return [s[: len(p) + n] for s, p, n in zip(seqs, prompts, num_tokens)]


def heldout_prompt_files(tokenizer, exclude: Sequence[Sequence[int]] = (), files=None) -> list[tuple[str, list[int]]]:
    """(path, tokens) of every held-out file (default: of the standard library; else `files`, objects with `path`
    and `text`) that contains none of `exclude`'s prompts (each prompt without its BOS)."""
    out = []
    for f in (files if files is not None else [f for f in stdlib_files() if f.held_out]):
        ids = tokenizer.encode(f.text, add_bos=False)
        text = "," + ",".join(map(str, ids)) + ","
        if any("," + ",".join(map(str, p[1:])) + "," in text for p in exclude):
            continue
        out.append((f.path, ids))
    return out


def cut_prompts(files: Sequence[tuple[str, list[int]]], newline_ids: set[int], num: int, context: int,
                room: int, rng: random.Random) -> list[list[int]]:
    """`num` prompts of BOS + `context` tokens: half end a line (`train_eval.completion_prompts`, as heldout.json's
    do), half end anywhere in a file; every cut leaves `room` tokens of the file after it."""
    files = [ids for _, ids in files if len(ids) > context + room + 2]
    records = [np.asarray([BOS, *ids, EOS], dtype=np.int64) for ids in files]
    starts = np.cumsum([0] + [len(r) for r in records[:-1]])
    line_ends = [p for p, _ in completion_prompts(np.concatenate(records), starts, newline_ids, num - num // 2,
                                                  context, room, seed=rng.randrange(2**31))]
    anywhere = []
    for _ in range(num // 2):
        ids = files[rng.randrange(len(files))]
        cut = rng.randrange(context, len(ids) - room)
        anywhere.append([BOS, *ids[cut - context : cut]])
    return [p for pair in zip(line_ends, anywhere) for p in pair] + line_ends[len(anywhere):]


def is_eval_file(path: str) -> bool:
    """About a quarter of the held-out files are kept for evaluating the head, chosen by a stable hash."""
    return int(hashlib.sha1(("confidence:" + path).encode()).hexdigest(), 16) % 4 == 0


# ----------------------------------------------------------------------------------------------- training

def train_head(train: DraftOutcomes, val: DraftOutcomes, hidden_size: int, seed: int, width: int = 32,
               epochs: int = 30, batch_size: int = 512, lr: float = 3e-3, weight_decay: float = 1e-3,
               log=print) -> tuple[ConfidenceHead, list[dict]]:
    """Adam on binary cross-entropy from a fixed seed; the epoch with the best validation loss is kept."""
    torch.manual_seed(seed)
    head = ConfidenceHead(hidden_size, width)
    head.set_standardisation(train.features)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=weight_decay)
    g = torch.Generator().manual_seed(seed)
    best, best_state, history = math.inf, None, []
    for epoch in tqdm(range(epochs), desc="train head", file=sys.stderr):
        head.train()
        for idx in torch.randperm(len(train), generator=g).split(batch_size):
            loss = torch.nn.functional.binary_cross_entropy_with_logits(head.logit(train.features[idx]),
                                                                        train.accepted[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
        head.eval()
        with torch.no_grad():
            val_loss = float(torch.nn.functional.binary_cross_entropy_with_logits(head.logit(val.features),
                                                                                  val.accepted))
        history.append(dict(epoch=epoch + 1, val_log_loss=round(val_loss, 5)))
        if val_loss < best:
            best, best_state = val_loss, copy.deepcopy(head.state_dict())
    head.load_state_dict(best_state)
    log(f"best validation log loss {best:.4f} at epoch {min(history, key=lambda h: h['val_log_loss'])['epoch']}")
    return head.eval().requires_grad_(False), history


def calibrated_top1(train: DraftOutcomes) -> torch.nn.Module:
    """A stronger baseline than the raw heuristic: logistic regression of acceptance on logit(top-1 probability)
    and the draft index (Platt scaling per chain position), fit on the same training outcomes. What the head
    gains over it comes from the hidden state and the distribution's shape."""
    x = _top1_inputs(train)
    model = torch.nn.Linear(x.shape[1], 1, dtype=torch.float64)
    torch.nn.init.zeros_(model.weight)
    torch.nn.init.zeros_(model.bias)
    opt = torch.optim.LBFGS(model.parameters(), max_iter=200, line_search_fn="strong_wolfe")
    y = train.accepted.double()

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x).squeeze(-1), y)
        loss.backward()
        return loss

    opt.step(closure)
    return model.requires_grad_(False)


def _top1_inputs(outcomes: DraftOutcomes) -> torch.Tensor:
    p = outcomes.top1_probability().double().clamp(1e-6, 1 - 1e-6)
    onehot = torch.nn.functional.one_hot(outcomes.draft_index.clamp(max=MAX_DRAFTS - 1), MAX_DRAFTS).double()
    return torch.cat([(p.log() - (1 - p).log())[:, None], onehot], dim=1)


# ----------------------------------------------------------------------------------------------- metrics

def log_loss(p: torch.Tensor, y: torch.Tensor) -> float:
    p = p.double().clamp(1e-6, 1 - 1e-6)
    return float(-(y * p.log() + (1 - y) * (1 - p).log()).mean())


def auc(p: torch.Tensor, y: torch.Tensor) -> float:
    """Probability that an accepted draft scores above a rejected one (ties count half)."""
    pos, neg = p[y > 0.5].double(), p[y <= 0.5].double()
    if len(pos) == 0 or len(neg) == 0:
        return float("nan")
    neg_sorted = neg.sort().values
    below = torch.searchsorted(neg_sorted, pos, right=False).double()
    ties = torch.searchsorted(neg_sorted, pos, right=True).double() - below
    return float((below + 0.5 * ties).sum() / (len(pos) * len(neg)))


def calibration(p: torch.Tensor, y: torch.Tensor, bins: int = 10) -> tuple[float, list[dict]]:
    """Expected calibration error over equal-width bins, and the bins (mean prediction vs acceptance rate)."""
    which = (p.double() * bins).long().clamp(0, bins - 1)
    ece, table = 0.0, []
    for b in range(bins):
        m = which == b
        if m.any():
            pred, rate = float(p[m].double().mean()), float(y[m].double().mean())
            ece += int(m.sum()) / len(p) * abs(pred - rate)
            table.append(dict(bin=f"{b / bins:.1f}-{(b + 1) / bins:.1f}", count=int(m.sum()),
                              mean_predicted=round(pred, 4), accepted_rate=round(rate, 4)))
    return ece, table


def score(p: torch.Tensor, y: torch.Tensor) -> dict:
    ece, table = calibration(p, y)
    return dict(log_loss=round(log_loss(p, y), 4), auc=round(auc(p, y), 4),
                brier=round(float(((p.double() - y) ** 2).mean()), 4), ece=round(ece, 4), calibration=table)


def evaluate(head: ConfidenceHead, outcomes: DraftOutcomes, baseline: torch.nn.Module | None = None) -> dict:
    with torch.no_grad():
        p_head = head(outcomes.features)
    p_top1 = outcomes.top1_probability()
    res = dict(rows=len(outcomes), accept_rate=round(float(outcomes.accepted.mean()), 4),
               head=score(p_head, outcomes.accepted), top1_heuristic=score(p_top1, outcomes.accepted))
    if baseline is not None:
        p_cal = torch.sigmoid(baseline(_top1_inputs(outcomes)).squeeze(-1))
        res["calibrated_top1"] = score(p_cal, outcomes.accepted)
    res["by_draft"] = []
    for j in range(int(outcomes.draft_index.max()) + 1):
        m = outcomes.draft_index == j
        res["by_draft"].append(dict(draft=j, rows=int(m.sum()),
                                    accept_rate=round(float(outcomes.accepted[m].mean()), 4),
                                    head_mean=round(float(p_head[m].mean()), 4),
                                    top1_mean=round(float(p_top1[m].mean()), 4)))
    return res


# ----------------------------------------------------------------------------------------------- main

def collect(model, prompts: list[list[int]], num_tokens: int, k: int, batch_size: int, desc: str,
            deadline: float | None = None) -> DraftOutcomes:
    """Outcomes of every batch of prompts; past `deadline` (a `time.time()`), stops after the batch in hand."""
    parts = []
    for i in tqdm(range(0, len(prompts), batch_size), desc=desc, file=sys.stderr):
        parts.append(log_draft_outcomes(model, prompts[i : i + batch_size], num_tokens, k))
        if deadline is not None and time.time() > deadline:
            break
    return DraftOutcomes.cat(parts)


def fit(model_dir: Path, out: Path | None = None, files=None, device: str = "cpu", train_prompts: int = 1024,
        eval_prompts: int = 256, context: int = 128, num_tokens: int = 16, k: int = 5, batch_size: int = 64,
        epochs: int = 30, width: int = 32, seed: int = 0, time_budget: float | None = None,
        exact: bool = True) -> dict:
    """Collect outcomes on held-out prompts, train the head, write it (default MODEL_DIR/HEAD_FILE) and return the
    training record. `files`: the held-out files to cut prompts from (default: the standard library's). With
    `time_budget` (seconds), outcome collection shares it: 1/8 validation, 5/8 training, 2/8 evaluation.
    `exact`: the reference backend's batch-invariant maths (slow; False: torch's kernels, ~1e-6 apart)."""
    from deepserve.backends.reference import ReferenceBackend
    from deepserve.model.factory import load_model
    from deepserve.model.tokenizer import Tokenizer

    t0 = time.time()
    model = load_model(model_dir, ReferenceBackend(device, exact=exact), dtype="float32", progress=False)
    tokenizer = Tokenizer(model_dir, model.cfg)
    heldout = model_dir / "heldout.json"
    exclude = [c["prompt"] for c in json.loads(heldout.read_text())["completion"]] if heldout.is_file() else []
    files = heldout_prompt_files(tokenizer, exclude, files)
    train_files = [f for f in files if not is_eval_file(f[0])]
    eval_files = [f for f in files if is_eval_file(f[0])]
    rng = random.Random(seed)
    room = num_tokens + 8
    newline_ids = {i for i in range(tokenizer.vocab_size) if (tokenizer.id_to_token(i) or "").endswith("Ċ")}
    train_p = cut_prompts(train_files, newline_ids, train_prompts, context, room, rng)
    eval_p = cut_prompts(eval_files, newline_ids, eval_prompts, context, room, rng)
    g = torch.Generator().manual_seed(seed)
    for prompts in (train_p, eval_p):  # every other pair of prompts gets 1-8 sampled tokens appended
        picked = [i for i in range(len(prompts)) if i % 4 >= 2]
        ext = extend_by_sampling(model, [prompts[i] for i in picked], [rng.randint(1, 8) for _ in picked], g)
        for i, p in zip(picked, ext):
            prompts[i] = p
    n_val = len(train_p) // 8

    def until(share: float) -> float | None:
        return None if time_budget is None else time.time() + share * max(0.0, time_budget - (time.time() - t0))

    val = collect(model, train_p[:n_val], num_tokens, k, batch_size, "val outcomes", until(1 / 8))
    train = collect(model, train_p[n_val:], num_tokens, k, batch_size, "train outcomes", until(5 / 7))
    test = collect(model, eval_p, num_tokens, k, batch_size, "eval outcomes", until(1.0))
    t_data = time.time() - t0
    print(f"outcomes: {len(train)} train, {len(val)} val, {len(test)} eval rows in {t_data:.0f} s", file=sys.stderr)

    head, history = train_head(train, val, model.cfg.hidden_size, seed, width, epochs)
    out = out or model_dir / HEAD_FILE
    head.save(out)
    result = evaluate(head, test, calibrated_top1(DraftOutcomes.cat([train, val])))
    for name in ("head", "calibrated_top1", "top1_heuristic"):
        print(f"{name:>16}: " + ", ".join(f"{k} {v}" for k, v in result[name].items() if k != "calibration"),
              file=sys.stderr)
    return dict(
        model=str(model_dir.name), python=python_version(), head_file=str(out.name), head_bytes=out.stat().st_size,
        seed=seed, device=device, k=k, context=context, num_tokens=num_tokens,
        files=dict(train=len(train_files), eval=len(eval_files)),
        rows=dict(train=len(train), val=len(val), eval=len(test)),
        seconds=dict(outcomes=round(t_data), total=round(time.time() - t0)), eval=result, history=history,
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", type=Path, default=EMBEDDED)
    ap.add_argument("--out", type=Path, default=None, help=f"head file (default: MODEL_DIR/{HEAD_FILE})")
    ap.add_argument("--record", type=Path, default=None, help="write the training record (json) here")
    ap.add_argument("--train-prompts", type=int, default=1024)
    ap.add_argument("--eval-prompts", type=int, default=256)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--num-tokens", type=int, default=16, help="greedy continuation length per prompt")
    ap.add_argument("--k", type=int, default=5, help="chained drafts per position")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="more than the free cores slows it down tenfold")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    record = fit(args.model_dir, args.out, None, "cpu", args.train_prompts, args.eval_prompts, args.context,
                 args.num_tokens, args.k, args.batch_size, args.epochs, args.width, args.seed)
    if args.record:
        record = dict(command=" ".join(["python -m deepserve.tools.train_confidence",
                                        *(argv if argv is not None else sys.argv[1:])]), threads=args.threads,
                      **record)
        record["files"]["excluded_for_tests"] = len([f for f in stdlib_files() if f.held_out]) - sum(
            record["files"].values())
        args.record.parent.mkdir(parents=True, exist_ok=True)
        args.record.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
