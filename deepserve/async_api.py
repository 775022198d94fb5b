"""The public `AsyncEngine`: `deepserve.core.async_engine.AsyncEngine` (the asyncio seam over a built engine)
plus `from_pretrained`, which builds that engine the way `LLM` does. It sits above `deepserve.core`, which
therefore never imports the code that builds engines."""

from __future__ import annotations

from typing import Any

from deepserve.core import async_engine
from deepserve.llm import LLM


class AsyncEngine(async_engine.AsyncEngine):
    """`engine = AsyncEngine.from_pretrained(DIR, **options); await engine.start()`, then
    `async for out in engine.generate(token_ids, params): ...`. `llm` keeps the tokenizer, the model and the
    engine's parts reachable; its own `generate` refuses to run while this object drives the engine."""

    def __init__(self, llm: LLM) -> None:
        super().__init__(llm.engine, llm.plugin_manager)
        self.llm = llm
        llm.async_owner = self

    @classmethod
    def from_pretrained(cls, model: str | None = None, **options: Any) -> AsyncEngine:
        """Build the engine as `LLM(model, **options)` does (the same options) and wrap it."""
        return cls(LLM(model, **options))
