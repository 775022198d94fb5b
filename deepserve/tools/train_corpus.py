"""The embedded model's corpus: Python's own standard library, read from the running interpreter.

Two kinds of example come out of it:
- *code*: every `.py` file of the standard library (its tests included), as `BOS + file + EOS`;
- *chat*: docstring -> function pairs. A user turn asks for the function its docstring describes, the assistant
  turn answers with the function in a fenced block. The prompt is rendered by deepseek-recipe's V4.1 encoding
  (thinking and non-thinking mode), so the chat endpoint's prompts are exactly what the model saw.

A stable hash of each file's path puts about 4% of the files in a held-out slice; nothing of a held-out file
(code or chat pair) is trained on. The standard library is PSF-licensed, which allows shipping a model
trained on it. Everything is deterministic for a given interpreter version and seed.
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import sys
import sysconfig
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

#: folders of the standard library that hold data rather than code
_SKIP_DIRS = frozenset({"site-packages", "__pycache__", "encodings", "pydoc_data"})
_MAX_FILE_BYTES = 400_000
HELD_OUT_PERCENT = 4

#: (spelling, special) for every token deepseek-recipe renders, in id order after BOS (0) and EOS (1).
#: As in DeepSeek's own tokenizer, the chat-structure tokens are not "special" (they survive decoding, so the
#: stream parser sees `</think>` and DSML markup), the sequence and vision tokens are.
CHAT_TOKENS = (
    "<｜User｜>", "<｜Assistant｜>", "<｜System｜>", "<think>", "</think>", "｜DSML｜", "<｜latest_reminder｜>",
)
VISION_TOKENS = (
    "<｜image｜>", "<｜ref｜>", "<｜/ref｜>", "<｜box｜>", "<｜/box｜>", "<｜point｜>", "<｜/point｜>",
    "<｜polygon｜>", "<｜/polygon｜>",
)
BOS, EOS = 0, 1


@dataclass(frozen=True, slots=True)
class SourceFile:
    path: str  # relative to the standard library root, '/'-separated
    text: str

    @property
    def held_out(self) -> bool:
        return is_held_out(self.path)


@dataclass(frozen=True, slots=True)
class FunctionPair:
    """A documented function of the standard library: what to ask for and the answer."""

    path: str
    qualname: str  # `name` or `Class.name`
    signature: str  # `(a, b=1)`
    doc: str  # cleaned docstring
    source: str  # dedented source, decorators and docstring included

    @property
    def held_out(self) -> bool:
        return is_held_out(self.path)


def is_held_out(path: str) -> bool:
    return int(hashlib.sha1(path.encode()).hexdigest(), 16) % 100 < HELD_OUT_PERCENT


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[SourceFile]:
    """Every readable `.py` file of the standard library, sorted by path; newlines normalised to `\\n`."""
    root = root or stdlib_root()
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if set(rel.parts[:-1]) & _SKIP_DIRS or rel.name.startswith("_sysconfigdata"):
            continue
        if p.stat().st_size > _MAX_FILE_BYTES:
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        text = text.replace("\r\n", "\n").replace("\r", "\n")
        if text.strip():
            out.append(SourceFile(rel.as_posix(), text))
    return out


def corpus_fingerprint(files: Sequence[SourceFile]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f.path.encode() + b"\0" + f.text.encode() + b"\0")
    return h.hexdigest()[:16]


def function_pairs(files: Iterable[SourceFile], max_chars: int = 1500) -> list[FunctionPair]:
    """Documented functions and methods whose source fits in `max_chars` and does more than hold a docstring."""
    pairs = []
    for f in files:
        try:
            tree = ast.parse(f.text)
        except (SyntaxError, ValueError):  # a few test files are deliberately broken
            continue
        lines = f.text.splitlines(keepends=True)
        for qualname, node in _documented_functions(tree):
            doc = ast.get_docstring(node)
            if not doc or len(doc) < 20 or len(node.body) < 2:
                continue
            start = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
            source = _dedent("".join(lines[start : node.end_lineno])).rstrip()
            if len(source) > max_chars:
                continue
            signature = "(" + ast.unparse(node.args) + ")"
            pairs.append(FunctionPair(f.path, qualname, signature, doc.strip(), source))
    return pairs


def _documented_functions(tree: ast.Module):
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield f"{node.name}.{item.name}", item


def _dedent(text: str) -> str:
    lines = text.splitlines()
    indent = min((len(line) - len(line.lstrip(" ")) for line in lines if line.strip()), default=0)
    return "\n".join(line[indent:] for line in lines) + "\n"


# -- chat rendering --------------------------------------------------------------------------------------------
_ASKS = (
    "Write a Python function `{name}{sig}`.\n\n{doc}",
    "{doc}\n\nImplement this in Python as `{name}{sig}`.",
    "Implement `{name}` in Python. Its docstring says:\n\n{doc}",
    "Write the Python code for `{name}{sig}`: {doc}",
)
_METHOD_ASKS = (
    "Write the method `{name}{sig}` of a Python class `{cls}`.\n\n{doc}",
    "{doc}\n\nImplement this as the method `{name}` of class `{cls}` in Python.",
)


@dataclass(frozen=True, slots=True)
class ChatText:
    """A rendered chat example: `prompt` is deepseek-recipe's rendering up to the assistant turn; the answer
    is `reasoning` (thinking mode only) then `answer`, and then EOS."""

    pair: FunctionPair
    thinking: bool
    user: str
    reasoning: str
    answer: str


#: plain requests, as a user types them ("Write a function that reverses a list."), from the docstring's summary
_PLAIN_ASKS = (
    "Write a function that {summary}",
    "Write a Python function that {summary}",
    "Can you write a function that {summary}",
)


def summary_clause(doc: str) -> str | None:
    """The docstring's first sentence as a relative clause ("Return the sum." -> "returns the sum."), or None when
    it does not start with an imperative verb (a capitalised word) or is not one short sentence."""
    first = doc.strip().split("\n\n", 1)[0].replace("\n", " ").strip()
    words = first.split(" ", 1)
    if len(words) < 2 or not words[0].isalpha() or not words[0][:1].isupper() or words[0][1:] != words[0][1:].lower():
        return None
    if not first.endswith(".") or len(first) > 160 or first.count(". ") > 0:
        return None
    verb = words[0].lower()
    if verb in ("this", "the", "a", "an", "it", "if", "for", "in", "deprecated", "internal", "helper", "private"):
        return None
    if verb.endswith(("s", "sh", "ch", "x", "z")):
        verb += "es"
    elif verb.endswith("y") and verb[-2:-1] not in "aeiou":
        verb = verb[:-1] + "ies"
    else:
        verb += "s"
    return f"{verb} {words[1]}"


def without_docstring(source: str) -> str | None:
    """A function's source with its docstring's lines taken out (the request already quotes it), or None when the
    docstring shares a line with other code or nothing but the docstring would be left."""
    try:
        node = ast.parse(source).body[-1]
    except (SyntaxError, ValueError, IndexError):
        return None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or ast.get_docstring(node) is None:
        return None
    doc, rest = node.body[0], node.body[1:]
    lines = source.splitlines()
    if not rest or doc.lineno == node.lineno or rest[0].lineno == doc.end_lineno:
        return None
    return "\n".join(lines[: doc.lineno - 1] + lines[doc.end_lineno :]).rstrip()


def short_chat_pairs(pairs: Sequence[FunctionPair], max_chars: int) -> list[FunctionPair]:
    """The pairs a chat answer is made of: public functions and methods (a user does not ask for `_helper`), the
    docstring dropped from the answer, at most `max_chars` of code left: short answers teach the model that an
    answer ends, with its closing fence, rather than running on as library code does."""
    out = []
    for p in pairs:
        name = p.qualname.rpartition(".")[2]
        if name.startswith("_") and not (name.startswith("__") and name.endswith("__")):
            continue
        body = without_docstring(p.source)
        if body is not None and len(body) <= max_chars:
            out.append(FunctionPair(p.path, p.qualname, p.signature, p.doc, body))
    return out


def chat_text(pair: FunctionPair, rng: random.Random, thinking_share: float = 0.3, plain_share: float = 0.0) -> ChatText:
    cls, _, name = pair.qualname.rpartition(".")
    doc = pair.doc if len(pair.doc) <= 600 else pair.doc[:600].rsplit(" ", 1)[0] + " ..."
    template = rng.choice(_METHOD_ASKS if cls else _ASKS)
    summary = summary_clause(pair.doc) if not cls and plain_share else None
    if summary is not None and rng.random() < plain_share:
        template = rng.choice(_PLAIN_ASKS)
        doc = summary
    user = template.format(name=name, sig=pair.signature, doc=doc, cls=cls, summary=doc)
    thinking = rng.random() < thinking_share
    args = pair.signature[1:-1] or "no arguments"
    what = f"the method `{name}` of `{cls}`" if cls else f"the function `{name}`"
    reasoning = f"The user wants {what}, taking ({args}). I will write it in Python." if thinking else ""
    # the closing fence on a line of its own, as Markdown writes it (the source has no trailing newline)
    return ChatText(pair, thinking, user, reasoning, f"```python\n{pair.source}\n```")


def render_prompt(encoding, user: str, thinking: bool) -> list[int]:
    """Token ids of the V4.1 prompt for one user turn, through deepseek-recipe's own prompt encoding."""
    import deepseek_recipe as dr

    return list(encoding.encode(dr.Conversation([dr.UserMessage(user)], thinking_mode=thinking)))


def v41_encoding(tokenizer_file: str | Path):
    import deepseek_recipe as dr

    return dr.DeepseekV41Encoding().with_tokenizer(dr.Tokenizer.from_file(str(tokenizer_file)))


# -- tokenizer -------------------------------------------------------------------------------------------------
def build_tokenizer(path: Path, train_texts: Iterable[str], vocab_size: int) -> Path:
    """Byte-level BPE of `vocab_size` ids learned from `train_texts`, holding every DeepSeek special token
    (BOS 0, EOS 1, then `CHAT_TOKENS`, then `VISION_TOKENS`). Also writes `tokenizer_config.json`, which asks
    for a BOS in front of plain prompts, as every training example starts with one."""
    from deepserve.model.tokenizer import make_byte_tokenizer

    specials = list(CHAT_TOKENS) + list(VISION_TOKENS)
    path.mkdir(parents=True, exist_ok=True)
    num_merges = vocab_size - 2 - len(specials) - 256
    file = make_byte_tokenizer(path, special_tokens=specials, train_text="".join(train_texts), num_merges=num_merges)
    data = json.loads(file.read_text(encoding="utf-8"))
    for tok in data["added_tokens"]:
        if tok["content"] in CHAT_TOKENS:
            tok["special"] = False
    file.write_text(json.dumps(data, ensure_ascii=False, indent=None), encoding="utf-8")
    config = {
        "add_bos_token": True, "add_eos_token": False, "bos_token": "<｜begin▁of▁sentence｜>",
        "eos_token": "<｜end▁of▁sentence｜>", "pad_token": "<｜end▁of▁sentence｜>",
        "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
    }
    (file.parent / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                       encoding="utf-8")
    return file


def python_version() -> str:
    return sys.version.split()[0]


#: the chat request shown in the model card (rendered at prepare time, so evaluation needs no deepseek-recipe)
CARD_CHAT_REQUEST = (
    "Write a Python function `is_palindrome(s)`.\n\nReturn True if the string s reads the same forwards and "
    "backwards, ignoring case."
)


# -- the prepared data set -----------------------------------------------------------------------------------------
DATA_FILE = "data.npz"
META_FILE = "meta.json"


def _pairs_of(f: SourceFile) -> list[FunctionPair]:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return function_pairs([f])


def prepare_data(out: Path, vocab_size: int, seed: int, chat_variants: int = 2, log=print,
                 files: Sequence[SourceFile] | None = None, tokenizer_chars: int | None = None,
                 max_pairs: int | None = None, plain_share: float = 0.0, processes: int = 1,
                 extra_meta: dict | None = None, chat_max_chars: int | None = None) -> Path:
    """Tokenizer plus token arrays of the whole corpus in `out` (`tokenizer.json`, `data.npz`, `meta.json`).

    Training code is one stream of `BOS file EOS` records (`code`, starting offsets in `code_doc_starts`); the
    training files' documented functions (every docstring -> function pair, not only the chat sample) are a
    second stream of `BOS function EOS` records (`functions`, `function_starts`), each dedented to its `def`
    line: the form of a function header's completion, body included, up to where the function ends; chat
    examples are `chat` with a loss mask over their answer tokens and offsets `chat_starts` (plus an end
    sentinel). The `heldout_*` arrays hold the same for the held-out files. With `chat_max_chars`, chat answers
    are `short_chat_pairs` (no docstring, at most that many characters of code), held-out ones too.
    """
    import numpy as np
    import tokenizers

    out.mkdir(parents=True, exist_ok=True)
    stdlib_only = files is None
    files = stdlib_files() if files is None else list(files)
    train_files = [f for f in files if not f.held_out]
    held_files = [f for f in files if f.held_out]
    log(f"corpus: {len(files)} files{' of Python ' + python_version() + chr(39) + 's standard library' if stdlib_only else ''}, "
        f"{len(held_files)} held out; fingerprint {corpus_fingerprint(files)}")
    tok_texts = [f.text for f in train_files]
    if tokenizer_chars is not None:  # learn the merges from a sample of the training files, in a seeded order
        order = sorted(range(len(train_files)),
                       key=lambda i: hashlib.sha1(f"{seed}:{train_files[i].path}".encode()).hexdigest())
        tok_texts, n = [], 0
        for i in order:
            if n >= tokenizer_chars:
                break
            tok_texts.append(train_files[i].text)
            n += len(train_files[i].text)
    tok_file = build_tokenizer(out, tok_texts, vocab_size)
    log(f"tokenizer: {vocab_size} ids, merges learned from {sum(map(len, tok_texts)) / 1e6:.1f} M characters")
    tok = tokenizers.Tokenizer.from_file(str(tok_file))
    end_think = tok.token_to_id("</think>")

    def code_stream(fs: list[SourceFile] | list[FunctionPair]):
        encoded = tok.encode_batch([f.text if isinstance(f, SourceFile) else f.source for f in fs],
                                   add_special_tokens=False)
        starts, pieces, n = [], [], 0
        for e in encoded:
            ids = [BOS, *e.ids, EOS]
            starts.append(n)
            pieces.append(np.asarray(ids, dtype=np.uint16))
            n += len(ids)
        return np.concatenate(pieces), np.asarray(starts, dtype=np.int64)

    encoding = v41_encoding(tok_file)
    rng = random.Random(seed)

    def chat_stream(pairs: list[FunctionPair], variants: int):
        ids_all, mask_all, starts, n = [], [], [], 0
        for pair in pairs:
            for _ in range(variants):
                c = chat_text(pair, rng, plain_share=plain_share)
                prompt = render_prompt(encoding, c.user, c.thinking)
                answer = tok.encode(c.answer, add_special_tokens=False).ids
                if c.thinking:
                    answer = tok.encode(c.reasoning, add_special_tokens=False).ids + [end_think] + answer
                ids = prompt + answer + [EOS]
                starts.append(n)
                ids_all.append(np.asarray(ids, dtype=np.uint16))
                mask_all.append(np.asarray([0] * len(prompt) + [1] * (len(answer) + 1), dtype=np.uint8))
                n += len(ids)
        starts.append(n)
        return np.concatenate(ids_all), np.concatenate(mask_all), np.asarray(starts, dtype=np.int64)

    code, code_starts = code_stream(train_files)
    held, held_starts = code_stream(held_files)
    if processes > 1:
        import multiprocessing as mp

        with mp.get_context("fork").Pool(processes) as pool:
            pairs = [p for ps in pool.map(_pairs_of, files, chunksize=16) for p in ps]
    else:
        pairs = function_pairs(files)
    train_pairs = [p for p in pairs if not p.held_out]
    held_pairs = [p for p in pairs if p.held_out]
    functions, function_starts = code_stream(train_pairs) if train_pairs else (np.zeros(0, np.uint16),
                                                                                 np.zeros(0, np.int64))
    chat_pairs, held_chat_pairs = train_pairs, held_pairs
    if chat_max_chars is not None:
        chat_pairs, held_chat_pairs = (short_chat_pairs(ps, chat_max_chars) for ps in (train_pairs, held_pairs))
    num_candidates = len(chat_pairs)
    if max_pairs is not None and len(chat_pairs) > max_pairs:  # a seeded sample, kept in corpus order
        keep = set(random.Random(seed).sample(range(len(chat_pairs)), max_pairs))
        chat_pairs = [p for i, p in enumerate(chat_pairs) if i in keep]
    chat, chat_mask, chat_starts = chat_stream(chat_pairs, chat_variants)
    hchat, hchat_mask, hchat_starts = chat_stream(held_chat_pairs, 1)
    counts = np.bincount(np.concatenate((code, chat[chat_mask.astype(bool)])).astype(np.int64), minlength=vocab_size)
    np.savez_compressed(
        out / DATA_FILE, code=code, code_doc_starts=code_starts, chat=chat, chat_mask=chat_mask,
        chat_starts=chat_starts, functions=functions, function_starts=function_starts, heldout_code=held, heldout_doc_starts=held_starts, heldout_chat=hchat,
        heldout_chat_mask=hchat_mask, heldout_chat_starts=hchat_starts, token_counts=counts,
    )
    meta = dict(
        python=python_version(), fingerprint=corpus_fingerprint(files), seed=seed, vocab_size=vocab_size,
        num_files=len(files), num_heldout_files=len(held_files), heldout_paths=[f.path for f in held_files],
        train_code_tokens=int(len(code)), heldout_code_tokens=int(len(held)), function_tokens=int(len(functions)),
        num_functions=len(function_starts), num_pairs=len(chat_pairs), num_chat_candidates=num_candidates,
        chat_max_chars=chat_max_chars,
        num_heldout_pairs=len(held_pairs), chat_tokens=int(len(chat)), chat_variants=chat_variants,
        heldout_pairs=[dict(path=p.path, qualname=p.qualname, signature=p.signature, doc=p.doc) for p in held_pairs],
        card_chat_prompt_ids=render_prompt(encoding, CARD_CHAT_REQUEST, thinking=False),
        **(extra_meta or {}),
    )
    (out / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
    log(f"tokens: {len(code):,} code + {len(functions):,} functions + {len(chat):,} chat for training; {len(held):,} code + {len(hchat):,} chat "
        f"held out; {len(train_pairs)} + {len(held_pairs)} docstring->function pairs")
    return out


def load_data(path: Path) -> tuple[dict, dict]:
    import numpy as np

    with np.load(path / DATA_FILE) as z:
        data = {k: z[k] for k in z.files}
    return data, json.loads((path / META_FILE).read_text())
