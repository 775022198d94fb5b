"""What clients send, honoured as they mean it (issue 25): every output-limit field and a documented default,
the thinking switches clients use, the `developer` role. On the tiny random V4 (the text is noise: the tests
check limits, modes and roles, not words)."""

from __future__ import annotations

import json

import pytest

from test_server import MODEL, USER, chat_dir, client, make_app  # noqa: F401 - fixtures

GREEDY = {"model": MODEL, "messages": USER, "temperature": 0, "seed": 0}


async def usage_and_finish(client, path: str, body: dict) -> tuple[dict, str]:
    r = await client.post(path, json=body)
    answer = await r.json()
    assert r.status == 200, answer
    if path == "/v1/responses":
        return answer["usage"], answer["status"]
    return answer["usage"], answer["choices"][0]["finish_reason"]


# -- item 1: every length field honoured -----------------------------------------------------------------------------
async def test_max_completion_tokens_is_the_limit_and_wins_over_max_tokens(client):
    for fields in ({"max_completion_tokens": 3}, {"max_completion_tokens": 3, "max_tokens": 9},
                   {"max_tokens": 3, "max_completion_tokens": None}):
        usage, finish = await usage_and_finish(client, "/v1/chat/completions", {**GREEDY, **fields})
        assert (usage["completion_tokens"], finish) == (3, "length"), fields


async def test_responses_max_output_tokens_is_the_limit(client):
    usage, status = await usage_and_finish(client, "/v1/responses", {"model": MODEL, "input": "hi",
                                                                      "max_output_tokens": 3, "temperature": 0})
    assert (usage["output_tokens"], status) == (3, "incomplete")


async def test_a_request_without_a_limit_gets_the_server_default(aiohttp_client, chat_dir):
    client = await aiohttp_client(make_app(chat_dir, default_max_tokens=5))
    usage, finish = await usage_and_finish(client, "/v1/chat/completions", GREEDY)
    assert (usage["completion_tokens"], finish) == (5, "length")
    usage, status = await usage_and_finish(client, "/v1/responses", {"model": MODEL, "input": "hi",
                                                                      "temperature": 0})
    assert (usage["output_tokens"], status) == (5, "incomplete")


async def test_the_default_limit_is_lowered_to_the_context_left(client):
    """max_model_len is 1024: a prompt of ~1020 tokens leaves a few, well under the 4,096 default."""
    long = [{"role": "user", "content": "y" * 1010}]
    usage, finish = await usage_and_finish(client, "/v1/chat/completions", {**GREEDY, "messages": long})
    assert finish == "length" and usage["prompt_tokens"] + usage["completion_tokens"] == 1024, usage


async def test_a_bad_max_completion_tokens_is_refused_once(client):
    r = await client.post("/v1/chat/completions", json={**GREEDY, "max_completion_tokens": 0, "max_tokens": 4})
    body = await r.json()
    assert r.status == 400 and body["error"]["param"] == "max_completion_tokens", body


def test_default_max_tokens_is_validated(chat_dir):
    with pytest.raises(ValueError, match="default_max_tokens"):
        make_app(chat_dir, default_max_tokens=0)


# -- item 3: thinking switches as clients send them ------------------------------------------------------------------
OFF_SWITCHES = [{"chat_template_kwargs": {"thinking": False}}, {"chat_template_kwargs": {"enable_thinking": False}},
                {"reasoning_effort": "none"}, {"thinking": {"type": "disabled"}},
                {"thinking": {"type": "disabled"}, "chat_template_kwargs": {"thinking": True}},  # `thinking` first
                {"chat_template_kwargs": {"thinking": False}, "reasoning_effort": "high"}]  # then the kwargs
ON_SWITCHES = [{"chat_template_kwargs": {"thinking": True}}, {"chat_template_kwargs": {"enable_thinking": True}},
               {"reasoning_effort": "low"}, {"thinking": {"type": "enabled"}},
               {"chat_template_kwargs": {"thinking": True}, "reasoning_effort": "none"}]


async def thinks(client, fields: dict) -> bool:
    """Whether a chat answer came in thinking mode: the random model never closes </think>, so in thinking mode
    its whole output is reasoning and `content` is empty."""
    r = await client.post("/v1/chat/completions", json={**GREEDY, "max_tokens": 6, **fields})
    message = (await r.json())["choices"][0]["message"]
    assert r.status == 200, message
    assert bool(message.get("reasoning_content")) != bool(message.get("content")), message
    return bool(message.get("reasoning_content"))


async def test_the_server_default_is_off_and_a_plain_client_gets_content(aiohttp_client, chat_dir):
    from deepserve.server import ServerConfig

    assert ServerConfig(model=str(chat_dir)).default_thinking_mode is False
    client = await aiohttp_client(make_app(chat_dir))
    assert not await thinks(client, {})
    for fields in ON_SWITCHES:
        assert await thinks(client, fields), fields


async def test_a_request_switches_thinking_off_on_a_thinking_server(aiohttp_client, chat_dir):
    client = await aiohttp_client(make_app(chat_dir, default_thinking_mode=True))
    assert await thinks(client, {})
    for fields in OFF_SWITCHES:
        assert not await thinks(client, fields), fields


async def test_messages_think_only_when_asked(aiohttp_client, chat_dir):
    """Anthropic's API: no thinking blocks unless the request asks, whatever the server's default."""
    client = await aiohttp_client(make_app(chat_dir, default_thinking_mode=True))
    body = {"model": MODEL, "messages": USER, "max_tokens": 6, "seed": 0}
    for fields, blocks in (({}, {"text"}), ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, {"thinking"})):
        r = await client.post("/v1/messages", json={**body, **fields})
        content = (await r.json())["content"]
        assert r.status == 200 and {block["type"] for block in content} == blocks, (fields, content)


@pytest.mark.parametrize("kwargs", [{"thinking": "yes"}, {"thinking": True, "enable_thinking": False}, ["x"]])
async def test_bad_chat_template_kwargs_are_refused(client, kwargs):
    r = await client.post("/v1/chat/completions", json={**GREEDY, "chat_template_kwargs": kwargs})
    body = await r.json()
    assert r.status == 400 and body["error"]["param"] == "chat_template_kwargs", body


@pytest.mark.parametrize("argv, mode", [([], False), (["--thinking", "on"], True), (["--thinking", "off"], False),
                                        (["--default-chat-template-kwargs", '{"thinking": true}'], True),
                                        (["--default-chat-template-kwargs", '{"enable_thinking": true}'], True),
                                        (["--default-chat-template-kwargs", '{"thinking": true}', "--thinking", "on"],
                                         True)])
def test_the_server_switch_on_the_command_line(argv, mode):
    from deepserve.cli import build_parser, thinking_default

    assert thinking_default(build_parser().parse_args(["serve", *argv])) is mode


@pytest.mark.parametrize("argv", [["--default-chat-template-kwargs", '{"thinking": true}', "--thinking", "off"],
                                  ["--default-chat-template-kwargs", "[1]"],
                                  ["--default-chat-template-kwargs", '{"thinking": 1}']])
def test_a_contradictory_or_bad_server_switch_is_an_error(argv):
    from deepserve.cli import build_parser, thinking_default

    with pytest.raises(ValueError):
        thinking_default(build_parser().parse_args(["serve", *argv]))


# -- item 6: roles and content ---------------------------------------------------------------------------------------
def prompt_ids(app, protocol, body: dict) -> list[int]:
    from deepserve.server.state import MODEL as MODEL_INFO, RECIPE

    prepared = app[RECIPE].prepare(protocol, json.dumps(body).encode(), body, app[MODEL_INFO])
    prepared.processor.close()
    return prepared.prompt_token_ids


async def test_the_developer_role_is_the_system_role(client):
    from deepserve.server.recipe import CHAT, RESPONSES

    def chat(role: str) -> dict:
        return {"model": MODEL, "messages": [{"role": role, "content": "Be brief."}, *USER]}

    def responses(role: str) -> dict:
        return {"model": MODEL, "input": [{"type": "message", "role": role, "content": [
            {"type": "input_text", "text": "Be brief."}]}, {"role": "user", "content": "hi"}]}

    for protocol, body in ((CHAT, chat), (RESPONSES, responses)):
        developer = prompt_ids(client.app, protocol, body("developer"))
        assert developer == prompt_ids(client.app, protocol, body("system"))
        assert developer != prompt_ids(client.app, protocol, body("user"))
    r = await client.post("/v1/chat/completions", json={**chat("developer"), "max_completion_tokens": 2})
    assert r.status == 200, await r.text()
    r = await client.post("/v1/responses", json={**responses("developer"), "max_output_tokens": 2})
    assert r.status == 200, await r.text()


async def test_an_image_is_refused_until_the_vision_encoder_exists(client):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    r = await client.post("/v1/chat/completions", json={**GREEDY, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "what is this?"}, image]}]})
    error = (await r.json())["error"]
    assert r.status == 400 and error["param"] == "messages[0].content[1]", error
    assert "vision-encoder role" in error["message"], error
