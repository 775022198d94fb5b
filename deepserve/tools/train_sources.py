"""The embedded model's corpus, v2: Python's standard library plus the sources of the packages installed beside
the interpreter, keeping only code whose licence is established as permissive.

Licences are checked at two levels:
- per package: the distribution's metadata, in this order: the SPDX `License-Expression` (PEP 639), the free-text
  `License` field (a short name, or a whole licence text recognised by its wording), the trove classifiers. An
  expression is permissive when every `AND` term (and at least one `OR` alternative) is in `PERMISSIVE`; a package
  whose licence cannot be read, or is not permissive, is left out whole;
- per file: a file's own header (its first `HEADER_CHARS` characters) is searched for an `SPDX-License-Identifier`
  and for copyleft or proprietary wording; a file that declares a non-permissive licence is dropped, whatever its
  package says. Files under a vendoring folder (`_vendor`, `third_party`, ...) hold others' code: they are kept only
  when their own header, or a licence file between them and the vendoring folder, establishes a permissive licence.

Only distributions installed in the interpreter's own site-packages count (wheels put elsewhere, e.g. on
`PYTHONPATH`, are not the machine's packages). Each file must parse with the running Python; exact duplicates are
kept once (the first in path order). Every decision is recorded per source (`Source.stats`) for the model card.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata as md
import os
import re
import site
import sys
import sysconfig
import warnings
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

#: SPDX identifiers taken as permissive (no copyleft, no field-of-use limits)
PERMISSIVE = frozenset({
    "MIT", "MIT-0", "MIT-CMU", "X11", "BSD-2-Clause", "BSD-3-Clause", "BSD-3-Clause-Clear", "0BSD", "Apache-2.0",
    "Apache-2.0 WITH LLVM-exception", "PSF-2.0", "Python-2.0", "CNRI-Python", "ISC", "Zlib", "Unlicense", "CC0-1.0",
    "HPND", "BSL-1.0", "NCSA", "UPL-1.0",
})
#: wording that marks a header (or a licence text) as copyleft or proprietary
_RESTRICTIVE = re.compile(
    r"General Public Licen[cs]e|Mozilla Public Licen[cs]e|Eclipse Public Licen[cs]e|European Union Public Licen[cs]e|"
    r"Common Development and Distribution Licen[cs]e|Server Side Public Licen[cs]e|Commons Clause|"
    r"Creative Commons Attribution-(NonCommercial|ShareAlike)|proprietary (licen[cs]e|and confidential|software)|"
    r"(?-i:\b(L?GPL|AGPL|MPL|EUPL|CDDL|SSPL)(-?v?[0-9.]+)?\b)", re.IGNORECASE)
_SPDX_LINE = re.compile(r"SPDX-License-Identifier:\s*([^\n*#\"']+)")
#: folders that hold code vendored from other projects
VENDOR_DIRS = frozenset({"_vendor", "vendor", "vendored", "_vendored", "extern", "_extern", "externals",
                         "third_party", "thirdparty", "_thirdparty", "3rdparty", "_third_party"})
_LICENCE_FILE = re.compile(r"^(LICEN[CS]E|COPYING|NOTICE)([._-].*)?$", re.IGNORECASE)
HEADER_CHARS = 4000
MAX_FILE_BYTES = 400_000
_STDLIB_SKIP = frozenset({"site-packages", "dist-packages", "__pycache__", "encodings", "pydoc_data"})

_CLASSIFIERS = {
    "MIT License": "MIT", "MIT No Attribution License (MIT-0)": "MIT-0", "BSD License": "BSD-3-Clause",
    "Apache Software License": "Apache-2.0", "Python Software Foundation License": "PSF-2.0",
    "ISC License (ISCL)": "ISC", "zlib/libpng License": "Zlib", "The Unlicense (Unlicense)": "Unlicense",
    "Historical Permission Notice and Disclaimer (HPND)": "HPND", "Boost Software License 1.0 (BSL-1.0)": "BSL-1.0",
    "University of Illinois/NCSA Open Source License": "NCSA",
}
_NAMES = {  # short free-text `License` fields, lower-cased, punctuation folded to spaces
    "mit": "MIT", "mit license": "MIT", "the mit license": "MIT", "expat": "MIT", "bsd": "BSD-3-Clause",
    "bsd license": "BSD-3-Clause", "new bsd": "BSD-3-Clause", "new bsd license": "BSD-3-Clause",
    "bsd 3 clause": "BSD-3-Clause", "bsd 3 clause license": "BSD-3-Clause", "3 clause bsd": "BSD-3-Clause",
    "modified bsd": "BSD-3-Clause", "bsd 2 clause": "BSD-2-Clause", "simplified bsd": "BSD-2-Clause",
    "apache 2 0": "Apache-2.0", "apache 2": "Apache-2.0", "apache license 2 0": "Apache-2.0",
    "apache license version 2 0": "Apache-2.0", "apache software license": "Apache-2.0",
    "apache 2 0 license": "Apache-2.0", "apache": "Apache-2.0", "psf": "PSF-2.0", "psfl": "PSF-2.0",
    "psf license": "PSF-2.0", "python software foundation license": "PSF-2.0", "isc": "ISC", "isc license": "ISC",
    "zlib": "Zlib", "unlicense": "Unlicense", "public domain cc0": "CC0-1.0", "cc0": "CC0-1.0",
}


# -- licence expressions ---------------------------------------------------------------------------------------
def expression_is_permissive(expr: str) -> bool:
    """Whether an SPDX licence expression allows shipping a model trained on the code: every AND term, and at least
    one OR alternative, permissive. Raises ValueError on an expression it cannot read."""
    tokens = re.findall(r"\(|\)|[A-Za-z0-9.+:-]+", expr)
    if not tokens:
        raise ValueError(f"empty licence expression {expr!r}")
    pos = 0

    def peek():
        return tokens[pos] if pos < len(tokens) else None

    def take():
        nonlocal pos
        if pos >= len(tokens):
            raise ValueError(f"licence expression {expr!r} ends early")
        pos += 1
        return tokens[pos - 1]

    def atom() -> bool:
        tok = take()
        if tok == "(":
            val = disjunction()
            if take() != ")":
                raise ValueError(f"unbalanced parentheses in {expr!r}")
            return val
        if tok in (")", "AND", "OR", "WITH"):
            raise ValueError(f"unexpected {tok!r} in {expr!r}")
        ident = tok.removesuffix("+")
        if (peek() or "").upper() == "WITH":
            take()
            ident = f"{ident} WITH {take()}"
        return ident in PERMISSIVE

    def conjunction() -> bool:
        val = atom()
        while (peek() or "").upper() == "AND":
            take()
            val = atom() and val
        return val

    def disjunction() -> bool:
        val = conjunction()
        while (peek() or "").upper() == "OR":
            take()
            val = conjunction() or val
        return val

    result = disjunction()
    if pos != len(tokens):
        raise ValueError(f"trailing {tokens[pos]!r} in licence expression {expr!r}")
    return result


def classify_licence_text(text: str) -> str | None:
    """The SPDX id of a whole licence text recognised by its wording (MIT, BSD-2/3-Clause, Apache-2.0, PSF, ISC),
    or None (unknown wording, or any copyleft or proprietary wording anywhere in it)."""
    if _RESTRICTIVE.search(text):
        return None
    t = " ".join(text.split())
    if "Apache License" in t and "Version 2.0" in t:
        return "Apache-2.0"
    if "Redistribution and use in source and binary forms" in t:
        return "BSD-3-Clause" if re.search(r"Neither the name|names of (its|the) contributors", t) else "BSD-2-Clause"
    if "Permission is hereby granted, free of charge" in t:
        return "MIT"
    if "PYTHON SOFTWARE FOUNDATION LICENSE" in t.upper() or "Python Software Foundation License" in t:
        return "PSF-2.0"
    if "Permission to use, copy, modify, and/or distribute this software for any purpose" in t:
        return "ISC"
    return None


@dataclass(slots=True)
class Licence:
    spdx: str | None  # the expression or id established, None when none could be
    permissive: bool
    evidence: str  # where it was read: "License-Expression", "License", "License (text)", "classifiers"


def package_licence(meta) -> Licence:
    """A distribution's licence from its metadata (see the module docstring for the order)."""
    expr = (meta.get("License-Expression") or "").strip()
    if expr:
        try:
            return Licence(expr, expression_is_permissive(expr), "License-Expression")
        except ValueError:
            return Licence(expr, False, "License-Expression (unreadable)")
    free = (meta.get("License") or "").strip()
    if free and free.upper() not in ("UNKNOWN", "NONE", "OTHER", "DUAL LICENSE"):
        if len(free) <= 80 and "\n" not in free:
            name = _NAMES.get(" ".join(re.sub(r"[^a-z0-9]+", " ", free.lower()).split()))
            if name:
                return Licence(name, True, "License")
            try:  # some packages put an SPDX expression in the old field
                if re.fullmatch(r"[A-Za-z0-9.+:() -]+", free) and (" OR " in free or " AND " in free or "-" in free):
                    return Licence(free, expression_is_permissive(free), "License (SPDX)")
            except ValueError:
                pass
        else:
            spdx = classify_licence_text(free)
            if spdx:
                return Licence(spdx, True, "License (text)")
    classifiers = [c.split("::")[-1].strip() for c in meta.get_all("Classifier") or [] if c.startswith("License ::")]
    if classifiers:
        ids = [_CLASSIFIERS.get(c) for c in classifiers]
        if all(ids):  # every classifier names a permissive licence
            return Licence(" AND ".join(dict.fromkeys(ids)), True, "classifiers")
        return Licence("; ".join(classifiers), False, "classifiers")
    return Licence(None, False, "none found")


def header_licence(text: str) -> tuple[bool | None, str]:
    """What a file's own header says: (True, why) permissive, (False, why) not, (None, "") silent."""
    head = text[:HEADER_CHARS]
    spdx = _SPDX_LINE.search(head)
    if spdx:
        expr = spdx.group(1).strip().rstrip("*/ ").strip()
        try:
            return expression_is_permissive(expr), f"SPDX {expr}"
        except ValueError:
            return False, f"unreadable SPDX {expr!r}"
    bad = _RESTRICTIVE.search(head)
    if bad:
        return False, f"header mentions {bad.group(0)!r}"
    spdx_text = classify_licence_text(head)
    if spdx_text:
        return True, f"header text {spdx_text}"
    return None, ""


# -- sources ---------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class Source:
    """Where files come from: the standard library or one installed distribution."""

    name: str
    version: str
    licence: Licence
    root: Path  # file paths are relative to it
    prefix: str  # the corpus path prefix: "" for the standard library, "site-packages/" for packages
    files: list[str] = field(default_factory=list)  # relative .py paths
    stats: Counter = field(default_factory=Counter)  # kept / dropped reasons

    def record(self) -> dict:
        return dict(name=self.name, version=self.version, licence=self.licence.spdx,
                    licence_evidence=self.licence.evidence, permissive=self.licence.permissive,
                    **{k: int(v) for k, v in sorted(self.stats.items())})


def stdlib_source() -> Source:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if set(rel.parts[:-1]) & _STDLIB_SKIP or rel.name.startswith("_sysconfigdata"):
            continue
        files.append(rel.as_posix())
    licence = Licence("PSF-2.0", True, "the Python distribution (python.org LICENSE)")
    return Source("python-stdlib", sys.version.split()[0], licence, root, "", files)


def site_dirs() -> list[Path]:
    """The interpreter's own site-packages folders (not PYTHONPATH entries, not the user site)."""
    return [Path(p).resolve() for p in site.getsitepackages() if Path(p).is_dir()]


def package_sources(exclude: Iterable[str] = ("deepserve",)) -> list[Source]:
    """One Source per distribution installed in `site_dirs()`, sorted by name (the first of duplicate names)."""
    dirs = site_dirs()
    skip = {n.lower().replace("_", "-") for n in exclude}
    out, seen = [], set()
    for dist in sorted(md.distributions(), key=lambda d: (d.metadata["Name"] or "").lower()):
        name = dist.metadata["Name"] or ""
        key = name.lower().replace("_", "-")
        if not name or key in seen or key in skip:
            continue
        base = Path(dist.locate_file("")).resolve()
        root = next((d for d in dirs if base == d or d in base.parents), None)
        if root is None:
            continue
        seen.add(key)
        files = sorted({str(f) for f in dist.files or () if str(f).endswith(".py") and ".." not in Path(f).parts})
        out.append(Source(name, dist.version, package_licence(dist.metadata), root, "site-packages/", files))
    return out


# -- files -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class FileCheck:
    path: str  # corpus path: prefix + relative path
    source: str
    text: str | None  # None when dropped
    reason: str  # "kept", "kept (vendored: ...)" or why it was dropped


def _vendored_root(rel: str) -> Path | None:
    parts = Path(rel).parts[:-1]
    for i, part in enumerate(parts):
        if part.lower() in VENDOR_DIRS:
            return Path(*parts[: i + 1])
    return None


def _nearby_licence(root: Path, rel: str, vendor_root: Path) -> tuple[bool | None, str]:
    """A licence file between the file's folder and its vendoring folder (inclusive), read by its wording."""
    here = Path(rel).parent
    while True:
        folder = root / here
        try:
            names = sorted(os.listdir(folder))
        except OSError:
            names = []
        for n in names:
            if _LICENCE_FILE.match(n) and (folder / n).is_file():
                try:
                    spdx = classify_licence_text((folder / n).read_text(encoding="utf-8", errors="replace"))
                except OSError:
                    continue
                return (True, f"{(here / n).as_posix()}: {spdx}") if spdx else (False, f"{(here / n).as_posix()}")
        if here == vendor_root or here == Path("."):
            return None, ""
        here = here.parent


def check_file(root: Path, rel: str, prefix: str, source: str) -> FileCheck:
    """Read one file and decide whether it enters the corpus (see the module docstring)."""
    path = prefix + rel
    p = root / rel
    try:
        if p.stat().st_size > MAX_FILE_BYTES:
            return FileCheck(path, source, None, "too large")
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return FileCheck(path, source, None, "unreadable")
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if not text.strip():
        return FileCheck(path, source, None, "empty")
    long_chars = sum(len(line) for line in text.split("\n") if len(line) > 200)
    if long_chars > 0.3 * len(text):
        return FileCheck(path, source, None, "generated (long lines)")
    verdict, why = header_licence(text)
    if verdict is False:
        return FileCheck(path, source, None, f"licence: {why}")
    vendor = _vendored_root(rel)
    kept = "kept"
    if vendor is not None:
        if verdict is None:
            verdict, why = _nearby_licence(root, rel, vendor)
        if not verdict:
            return FileCheck(path, source, None, "vendored, licence not established")
        kept = f"kept (vendored: {why})"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return FileCheck(path, source, None, "does not parse")
    return FileCheck(path, source, text, kept)


def _check_args(args: tuple) -> FileCheck:
    return check_file(*args)


def collect_files(sources: Sequence[Source], max_package_bytes: int | None, seed: int = 0, processes: int = 1,
                  max_files_per_source: int | None = None, log=print) -> list[FileCheck]:
    """Check the files of every permissive source (a non-permissive source is dropped whole) and return the kept
    ones, deduplicated, sorted by path. A package keeps at most `max_package_bytes` of text, its files taken in an
    order fixed by `seed` (the standard library is never capped); of identical files the standard library's copy
    wins, then a package's own over a vendored one."""
    jobs = []
    for s in sources:
        if not s.licence.permissive:
            s.stats["dropped: package licence"] = len(s.files)
            continue
        files = sorted(s.files, key=lambda r: _order(seed, s.name, r)) if s.prefix else list(s.files)
        if max_files_per_source is not None:
            files = files[:max_files_per_source]
        if s.prefix and max_package_bytes is not None:  # check only about what the cap can take
            room, picked = 2 * max_package_bytes, []
            for rel in files:
                try:
                    size = (s.root / rel).stat().st_size
                except OSError:
                    size = 0
                if room <= 0:
                    s.stats["dropped: over the package cap"] += 1
                    continue
                picked.append(rel)
                room -= min(size, MAX_FILE_BYTES)
            files = picked
        jobs.extend((s.root, rel, s.prefix, s.name) for rel in files)
    if processes > 1:
        import multiprocessing as mp

        with mp.get_context("fork").Pool(processes) as pool:
            checks = pool.map(_check_args, jobs, chunksize=32)
    else:
        checks = [_check_args(j) for j in jobs]
    by_source: dict[str, list[FileCheck]] = {}
    for c in checks:
        by_source.setdefault(c.source, []).append(c)
    kept, seen, used = [], set(), Counter()
    for vendored_pass in (False, True):
        for s in sources:
            for c in by_source.get(s.name, []):
                if (c.reason.startswith("kept (vendored")) != vendored_pass:
                    continue
                if c.text is None:
                    s.stats[f"dropped: {c.reason.split(':')[0]}"] += 1
                    continue
                digest = hashlib.sha1(c.text.encode()).digest()
                if digest in seen:
                    s.stats["dropped: duplicate"] += 1
                    continue
                if s.prefix and max_package_bytes is not None and used[s.name] + len(c.text) > max_package_bytes:
                    s.stats["dropped: over the package cap"] += 1
                    continue
                seen.add(digest)
                used[s.name] += len(c.text)
                s.stats["kept"] += 1
                if vendored_pass:
                    s.stats["kept vendored"] += 1
                kept.append(c)
    for s in sources:
        s.stats["kept_bytes"] = used[s.name]
    kept.sort(key=lambda c: c.path)
    log(f"sources: {sum(s.licence.permissive for s in sources)} of {len(sources)} permissive; "
        f"{len(kept)} files kept of {len(jobs)} checked, {sum(len(c.text) for c in kept) / 1e6:.1f} MB")
    return kept


def _order(seed: int, name: str, path: str) -> str:
    return hashlib.sha1(f"{seed}:{name}:{path}".encode()).hexdigest()
