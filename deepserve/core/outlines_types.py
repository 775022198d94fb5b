"""outlines' type system in `SamplingParams(structured_outputs=...)`: an outlines type becomes the
`structured_outputs` dict it stands for (see `deepserve.core.structured.typed_constraint`, which imports this
module only for values that come from outlines).

| outlines type | structured_outputs |
| --- | --- |
| `JsonSchema(schema)` (from a dict, JSON text, Pydantic model, TypedDict, dataclass) | `{"json": schema}`; a `whitespace_pattern` asks for free whitespace: `compact_json=False` |
| `CFG(definition)` (a Lark grammar) | `{"grammar": definition}`: the engine's default backend compiles it (outlines_core has no grammars) |
| `Choice([str, ...])` | `{"choice": [...]}` |
| `Regex(pattern)` and every other regex term (`integer`, `either(...)`, `Regex("a") + ...`) | `{"regex": outlines' regex of it}` |
"""

from __future__ import annotations

import json
from typing import Any

from outlines.types import CFG, Choice, JsonSchema
from outlines.types.dsl import Term, to_regex


def outlines_constraint(value: Any) -> dict[str, Any] | None:
    """The `structured_outputs` dict of an outlines type, or None when `value` is not one (an outlines model,
    generator...). Raises ValueError for a type that has no constraint form."""
    if isinstance(value, JsonSchema):
        constraint: dict[str, Any] = {"json": json.loads(value.schema)}
        if value.whitespace_pattern is not None:
            constraint["compact_json"] = False
        return constraint
    if isinstance(value, CFG):
        return {"grammar": value.definition}
    if isinstance(value, Choice) and value.items and all(isinstance(item, str) for item in value.items):
        return {"choice": list(value.items)}
    if isinstance(value, Term):
        try:
            return {"regex": to_regex(value)}
        except (TypeError, ValueError, NotImplementedError) as exc:
            raise ValueError(f"structured_outputs: the outlines type {value!r} has no regex form: {exc}") from None
    return None
