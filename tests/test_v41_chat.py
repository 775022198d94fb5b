"""The V4.1 chat format through deepseek-recipe: a `deepseek_v41` checkpoint's chat requests are rendered with
`DeepseekV41Encoding` (its `<｜System｜>` turn, V4.1's reasoning-effort line) and generate through the V4.1
engine; a tokenizer without the chat tokens says chat is unavailable."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import deepseek_recipe as dr
import pytest

from deepserve.core.plugins import make_plugin_manager
from deepserve.model.v41.engram import normalized_token_map
from deepserve.server import ServerConfig, create_app

TINY = Path(__file__).parent / "golden" / "v41" / "tiny_a" / "tiny"
CHAT_TOKENS = ["<｜System｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"]
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ba be"}]


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory) -> Path:
    """tiny_a with five of its filler words turned into V4.1's chat tokens (Engram's normalized vocabulary,
    which the hash depends on, recounted)."""
    from tokenizers import Tokenizer

    out = tmp_path_factory.mktemp("v41chat") / "tiny"
    shutil.copytree(TINY, out)
    tok = json.loads((out / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    for word, token in zip(["x171", "x172", "x173", "x174", "x175"], CHAT_TOKENS):
        vocab[token] = vocab.pop(word)
        tok["added_tokens"].append({"id": vocab[token], "content": token, "single_word": False, "lstrip": False,
                                    "rstrip": False, "normalized": False, "special": True})
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    _, size = normalized_token_map(Tokenizer.from_file(str(out / "tokenizer.json")))
    for name, key in (("config.json", "engram_compressed_vocab_size"), ("inference/config.json", None)):
        cfg = json.loads((out / name).read_text())
        (cfg["text_config"] if key else cfg)["engram_compressed_vocab_size"] = size
        (out / name).write_text(json.dumps(cfg))
    return out


async def client_for(aiohttp_client, model_dir: Path):
    config = ServerConfig(model=str(model_dir), served_model_name="v41", default_thinking_mode=False,
                          engine_kwargs={"block_size": 128, "max_num_seqs": 2, "kv_cache_bytes": 8 * 2**20})
    return await aiohttp_client(create_app(config, plugin_manager=make_plugin_manager(load_entrypoints=False)))


async def test_chat_prompts_render_in_the_v41_format(aiohttp_client, chat_dir):
    client = await client_for(aiohttp_client, chat_dir)
    r = await client.post("/tokenize", json={"model": "v41", "messages": MESSAGES})
    assert r.status == 200, await r.text()
    tokens = (await r.json())["tokens"]
    tok = dr.Tokenizer.from_file(str(chat_dir / "tokenizer.json"))
    conv = dr.Conversation([dr.SystemMessage("be brief"), dr.UserMessage("ba be")], thinking_mode=False)
    assert tokens == dr.DeepseekV41Encoding().with_tokenizer(tok).encode(conv)
    assert tok.encode("<｜System｜>")[0] in tokens  # V4.1's system turn; V4 writes the system prompt bare
    r = await client.post("/v1/chat/completions", json={"model": "v41", "messages": MESSAGES, "max_tokens": 3,
                                                        "temperature": 0})
    assert r.status == 200, await r.text()
    body = await r.json()
    assert body["usage"]["prompt_tokens"] == len(tokens) and body["usage"]["completion_tokens"] <= 3


async def test_a_tokenizer_without_chat_tokens_says_so(aiohttp_client):
    client = await client_for(aiohttp_client, TINY)
    r = await client.post("/v1/chat/completions", json={"model": "v41", "messages": MESSAGES, "max_tokens": 1})
    assert r.status >= 400
    assert "cannot encode V4.1 chat prompts" in await r.text()
