"""Imports point one way: every import in the package, at module level or inside a function, goes to a layer
below its own (or stays in its own package). `deepserve.core` imports nothing of deepserve above it and no
torch or aiohttp; the model and the backends do not import each other; plugins use the model's public API.
"""

from __future__ import annotations

import ast
from pathlib import Path

import deepserve

PACKAGE = Path(deepserve.__file__).parent

#: each part's layer: an import must go to a lower layer, or within the same part
LAYERS = {
    "deepserve.core": 0,
    "deepserve.sampling": 1,
    "deepserve.backends": 2,
    "deepserve.model": 2,
    "deepserve.distributed": 2.5,  # above the model it wires, below the plugins that implement its seams
    "deepserve.plugins": 3,
    "deepserve.build": 4,
    "deepserve.llm": 5,
    "deepserve.async_api": 6,
    "deepserve": 7,  # the package's own __init__: the public API
    "deepserve.server": 8,
    "deepserve.tools": 9,
    "deepserve.cli": 9,
    "deepserve.__main__": 10,
}
#: third-party packages deepserve.core may import (lazily, inside the function that needs them, where noted)
CORE_THIRD_PARTY = {"pluggy", "outlines"}  # outlines: core/outlines_types, imported only for an outlines value


def part_of(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 and ".".join(parts[:2]) in LAYERS else "deepserve"


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every import statement in the file, nested ones too (not those under
    `if TYPE_CHECKING:`)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), filename=str(path))
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and getattr(block.test, "id", None) == "TYPE_CHECKING" for n in ast.walk(block)}
    found = []
    for node in ast.walk(tree):
        if id(node) in typing_only:  # annotations only: never imported at run time
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                found.append((node.lineno, ".".join(base + ([node.module] if node.module else []))))
            else:
                found.append((node.lineno, node.module or ""))
    return found


def test_every_import_points_down():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = module_name(path)
        here = part_of(source)
        for line, target in imports_of(path):
            if target.partition(".")[0] != "deepserve":
                continue
            there = part_of(target)
            if there != here and LAYERS[there] >= LAYERS[here]:
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {here} imports {target}")
    assert not upward, "imports that point up or sideways:\n" + "\n".join(upward)


def test_core_imports_no_torch_no_aiohttp():
    stdlib = set(__import__("sys").stdlib_module_names)
    foreign = []
    for path in sorted((PACKAGE / "core").rglob("*.py")):
        for line, target in imports_of(path):
            top = target.partition(".")[0]
            if top not in stdlib and top != "deepserve" and top not in CORE_THIRD_PARTY:
                foreign.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {target}")
    assert not foreign, "deepserve.core imports outside its allowance:\n" + "\n".join(foreign)


def test_the_rule_catches_an_upward_import(tmp_path):
    bad = tmp_path / "deepserve" / "core" / "bad.py"
    bad.parent.mkdir(parents=True)
    bad.write_text("def f():\n    from deepserve.llm import LLM\n    from ..server import app\n")
    found = [target for _, target in imports_of_at(bad, tmp_path / "deepserve")]
    assert found == ["deepserve.llm", "deepserve.server"]
    assert all(LAYERS[part_of(t)] > LAYERS["deepserve.core"] for t in found)


def imports_of_at(path: Path, package_root: Path) -> list[tuple[int, str]]:
    global PACKAGE
    saved, PACKAGE = PACKAGE, package_root
    try:
        return imports_of(path)
    finally:
        PACKAGE = saved

