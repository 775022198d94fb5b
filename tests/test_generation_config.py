"""The model's sampling defaults from its generation_config.json (vLLM's `--generation-config`): read and checked
(`deepserve.core.generation_config`), used by `LLM.generate` without parameters and by every server route for the
fields a request leaves out, and ignored with `generation_config="vllm"`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from deepserve.core.generation_config import sampling_defaults
from deepserve.core.sampling_params import SamplingParams
from test_server import MODEL, chat_dir, make_app  # noqa: F401 - fixtures

DEFAULTS = {"temperature": 0.0, "repetition_penalty": 1.3, "max_new_tokens": 5, "do_sample": True,
            "bos_token_id": 0, "top_p": None}


def write(folder: Path, content) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generation_config.json").write_text(content if isinstance(content, str) else json.dumps(content))
    return folder


def test_fields_are_read_as_vllm_reads_them(tmp_path):
    write(tmp_path / "m", DEFAULTS)
    assert sampling_defaults("auto", tmp_path / "m") == {"temperature": 0.0, "repetition_penalty": 1.3,
                                                         "max_tokens": 5}
    assert sampling_defaults("vllm", tmp_path / "m") == {}
    assert sampling_defaults("auto", tmp_path) == {}  # no file: the library's defaults
    write(tmp_path / "other", {"top_k": 7, "min_p": 0.1})
    assert sampling_defaults(str(tmp_path / "other"), tmp_path / "m") == {"top_k": 7, "min_p": 0.1}


@pytest.mark.parametrize("content, message", [
    ("{not json", "cannot be read as JSON"),
    ("[1, 2]", "must hold a JSON object"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_new_tokens": "many"}, "max_tokens"),
])
def test_a_bad_file_is_an_error_naming_it(tmp_path, content, message):
    write(tmp_path, content)
    with pytest.raises(ValueError, match=message) as info:
        sampling_defaults("auto", tmp_path)
    assert "generation_config.json" in str(info.value)


def test_a_folder_without_the_file_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        sampling_defaults(str(tmp_path), None)


@pytest.fixture(scope="module")
def defaults_dir(chat_dir, tmp_path_factory):  # noqa: F811
    folder = tmp_path_factory.mktemp("with-defaults") / "model"
    shutil.copytree(chat_dir, folder)
    return write(folder, DEFAULTS)


def test_llm_generate_without_parameters_uses_them(defaults_dir):
    from deepserve import LLM

    llm = LLM(model=str(defaults_dir), accelerator="cpu", load_plugins=False)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=5)
    prompt = {"prompt_token_ids": [5, 9, 9, 9, 9, 12, 40]}
    implicit = llm.generate([prompt], use_tqdm=False)[0].outputs[0]
    explicit = llm.generate([prompt], SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=5),
                            use_tqdm=False)[0].outputs[0]
    assert implicit.token_ids == explicit.token_ids and len(implicit.token_ids) <= 5
    vllm = LLM(model=str(defaults_dir), accelerator="cpu", load_plugins=False, generation_config="vllm")
    assert vllm.get_default_sampling_params() == SamplingParams()


async def test_server_requests_take_the_fields_they_leave_out(aiohttp_client, defaults_dir):
    client = await aiohttp_client(make_app(defaults_dir))
    prompt = [5, 9, 9, 9, 9, 12, 40]

    async def completion(**fields) -> dict:
        response = await client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, **fields})
        assert response.status == 200, await response.text()
        return await response.json()

    implicit = await completion()
    explicit = await completion(temperature=0, repetition_penalty=1.3, max_tokens=5)
    assert implicit["choices"][0]["text"] == explicit["choices"][0]["text"]
    assert implicit["usage"]["completion_tokens"] <= 5
    longer = await completion(max_tokens=9, ignore_eos=True)  # what the request sets wins
    assert longer["usage"]["completion_tokens"] == 9

    async def chat(**fields) -> dict:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], **fields}
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status == 200, await response.text()
        return await response.json()

    first, second = await chat(), await chat()  # greedy by the model's default, unseeded
    assert first["choices"][0]["message"] == second["choices"][0]["message"]
    assert first["usage"]["completion_tokens"] <= 5
    assert first["choices"][0]["message"] == (await chat(temperature=0, repetition_penalty=1.3,
                                                         max_tokens=5))["choices"][0]["message"]


async def test_server_with_vllm_defaults_ignores_the_file(aiohttp_client, defaults_dir):
    client = await aiohttp_client(make_app(defaults_dir, engine={"generation_config": "vllm"}))
    response = await client.post("/v1/completions", json={"model": MODEL, "prompt": [5, 9, 12], "ignore_eos": True})
    assert response.status == 200, await response.text()
    assert (await response.json())["usage"]["completion_tokens"] == 16  # OpenAI's default, not max_new_tokens


def test_the_serve_flag_reaches_the_engine_options():
    from deepserve.cli import build_parser, engine_options

    assert engine_options(build_parser().parse_args(["serve"]))["generation_config"] == "auto"
    assert engine_options(build_parser().parse_args(["serve", "--generation-config", "vllm"]))[
        "generation_config"] == "vllm"


def test_a_default_speculation_cannot_honour_is_left_out(caplog):
    """The embedded model's repetition penalty under MTP speculation, which refuses logits processors: requests
    that set nothing run without it (logged once at start-up); one that asks for it gets the engine's error."""
    from deepserve import LLM

    with caplog.at_level("WARNING", logger="deepserve.core.generation_config"):
        llm = LLM(accelerator="cpu", load_plugins=True, max_model_len=512, max_num_seqs=2, block_size=128,
                  speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert "repetition_penalty" not in llm.sampling_defaults and "speculative decoding" in caplog.text
    out = llm.generate(["def add(a, b):"], use_tqdm=False)[0].outputs[0]
    assert out.token_ids
    with pytest.raises(ValueError, match="speculative decoding"):
        llm.generate(["x"], SamplingParams(repetition_penalty=1.1), use_tqdm=False)
