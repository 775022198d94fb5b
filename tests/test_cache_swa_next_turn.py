"""A finished turn's SWA host slot is saved before the conversation's next turn can look it up (docs/cache.md,
"SWA host slots"): the save goes to the runner's thread the moment the turn finishes, and a new request's lookup
waits for saves still pending. So a next turn sent the instant the previous response arrives restores its tail
from the slot instead of recomputing it."""

from __future__ import annotations

import random

from deepserve import SamplingParams
from deepserve.server.state import ENGINE
from test_server import chat_dir, make_app  # noqa: F401 - fixtures

P = 128
TURN1 = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
TURN2 = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


async def last(stream):
    out = None
    async for out in stream:
        pass
    return out


async def test_a_next_turn_sent_as_the_response_arrives_finds_the_slot(aiohttp_client, chat_dir):
    client = await aiohttp_client(make_app(chat_dir, engine={"swa_host_slots": 4}))
    engine = client.app[ENGINE]
    rng = random.Random(4)
    for turn in range(4):  # several conversations: a save that lagged would miss in some of them
        first = [rng.randrange(3, 250) for _ in range(140 + 3 * turn)]
        out = await last(engine.generate(first, TURN1, session_id=f"s{turn}"))
        second = first + list(out.outputs[0].token_ids) + [rng.randrange(3, 250) for _ in range(9)]
        again = await last(engine.generate(second, TURN2, session_id=f"s{turn}"))  # at once, no wait
        # the slot holds the state after the first turn's tokens (the last sampled one maybe not yet fed)
        assert len(first) + 5 <= again.num_cached_tokens <= len(first) + 6, (turn, again.num_cached_tokens)
    slots = engine.engine.swa_slots.snapshot()
    assert slots.num_restores == 4 and slots.num_saves >= 4
