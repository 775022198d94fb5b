"""The client x feature audit of issue 25: each client library, unmodified, against a running `deepserve serve`,
one check per feature the issue lists; writes the table as JSON and prints it as Markdown.

    deepserve serve --served-model-name tiny --accelerator cpu --max-model-len 2048 --port 8123 &
    python bench/client_audit.py --url http://127.0.0.1:8123 --out bench/results/client_audit.json \
        [--lm-eval /tmp/lmeval-venv/bin/lm_eval]

The server runs with its defaults (thinking off). A check passes when the client call succeeds and what a user
would look at is right (the length honoured, n choices, a tool call whose arguments fit the schema, ...).
lm-eval runs as its own command (a side venv, `--lm-eval`); aiperf has its own script, bench/aiperf_run.sh.
Every tokenizer is the model's own; nothing comes from a hub.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import traceback
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Literal

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

MODEL = "tiny"
KEY = "sk-local"
EMBEDDED = Path(__file__).resolve().parent.parent / "deepserve" / "assets" / "deepserve-tiny-v4"
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"],
    "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather forecast for a city",
                                         "parameters": WEATHER}}
ASK = "What is the weather in Paris for the next 3 days?"
HI = [{"role": "user", "content": "Write a short poem about the sea."}]
IMAGE = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kg"
         "AAAABJRU5ErkJggg==")  # a 1x1 PNG


def fits(arguments: str | dict) -> dict:
    import jsonschema

    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(args, WEATHER)
    return args


def usage_adds_up(usage) -> None:
    u = usage if isinstance(usage, dict) else usage.model_dump()
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"], u
    reasoning = (u.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    assert reasoning <= u["completion_tokens"], u


class Audit:
    def __init__(self, url: str) -> None:
        self.url = url
        self.rows: list[dict] = []

    def check(self, client: str, feature: str, fn: Callable[[], str | None]) -> None:
        try:
            detail = fn() or ""
            ok = True
        except Exception as exc:  # noqa: BLE001 - recorded as the cell's failure
            ok, detail = False, f"{type(exc).__name__}: {exc}"[:300]
            traceback.print_exc()
        self.rows.append({"client": client, "feature": feature, "works": ok, "detail": detail})
        print(f"{'works ' if ok else 'FAILS '} {client:18} {feature:40} {detail}", flush=True)

    # -- openai SDK --------------------------------------------------------------------------------------------------
    def openai_sdk(self) -> None:
        import openai

        c = openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0)
        name = "openai SDK"

        def length():
            r = c.chat.completions.create(model=MODEL, messages=HI, max_completion_tokens=5)
            assert r.usage.completion_tokens <= 5 and r.choices[0].finish_reason == "length", r.usage
            usage_adds_up(r.usage)
            r2 = c.chat.completions.create(model=MODEL, messages=HI, max_tokens=50, max_completion_tokens=4)
            assert r2.usage.completion_tokens <= 4, r2.usage
            return f"{r.usage.completion_tokens} tokens for max_completion_tokens=5"

        def default_length():
            r = c.chat.completions.create(model=MODEL, messages=HI, temperature=0)
            assert r.choices[0].message.content, "empty content"
            usage_adds_up(r.usage)
            return f"{r.usage.completion_tokens} tokens, finish {r.choices[0].finish_reason}, answer in content"

        def n2():
            r = c.chat.completions.create(model=MODEL, messages=HI, max_completion_tokens=4, n=2, seed=1)
            assert [ch.index for ch in r.choices] == [0, 1]
            usage_adds_up(r.usage)
            return "2 choices"

        def penalties():
            r = c.chat.completions.create(model=MODEL, messages=HI, max_completion_tokens=6, presence_penalty=1.0,
                                          frequency_penalty=0.5, logit_bias={"100": -100, "200": 5}, seed=3)
            assert r.choices[0].message.content is not None
            r = c.chat.completions.create(model=MODEL, messages=HI, max_completion_tokens=6,
                                          extra_body={"repetition_penalty": 1.3, "bad_words": ["the"]})
            return "presence/frequency/logit_bias; repetition_penalty, bad_words via extra_body"

        def developer():
            r = c.chat.completions.create(model=MODEL, max_completion_tokens=4, messages=[
                {"role": "developer", "content": "Answer briefly."}, *HI])
            assert r.choices[0].message.content is not None
            return "200"

        def tools_required():
            r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}], tools=[TOOL],
                                          tool_choice="required", max_completion_tokens=200)
            call = r.choices[0].message.tool_calls[0]
            assert call.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
            return f"arguments {fits(call.function.arguments)}"

        def tools_named_stream():
            s = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}], tools=[TOOL],
                                          tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                          max_completion_tokens=200, stream=True)
            args, names = "", set()
            for chunk in s:
                for d in chunk.choices[0].delta.tool_calls or () if chunk.choices else ():
                    names.add(d.function.name) if d.function.name else None
                    args += d.function.arguments or ""
            assert names == {"get_weather"}, names
            return f"streamed deltas, arguments {fits(args)}"

        def tools_auto():
            r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}], tools=[TOOL],
                                          tool_choice="auto", max_completion_tokens=20)
            return f"finish {r.choices[0].finish_reason}, {len(r.choices[0].message.tool_calls or [])} calls parsed"

        def thinking():
            on = c.chat.completions.create(model=MODEL, messages=HI, max_completion_tokens=8,
                                           extra_body={"chat_template_kwargs": {"thinking": True}})
            usage_adds_up(on.usage)
            assert on.usage.completion_tokens_details.reasoning_tokens > 0, on.usage
            on2 = c.chat.completions.create(model=MODEL, messages=HI, max_completion_tokens=8,
                                            extra_body={"chat_template_kwargs": {"enable_thinking": True}})
            assert on2.usage.completion_tokens_details.reasoning_tokens > 0, on2.usage
            on3 = c.chat.completions.create(model=MODEL, messages=HI, max_completion_tokens=8, reasoning_effort="high")
            assert on3.usage.completion_tokens_details.reasoning_tokens > 0, on3.usage
            on4 = c.chat.completions.create(model=MODEL, messages=HI, max_completion_tokens=8,
                                            extra_body={"thinking": {"type": "enabled"}})
            assert on4.usage.completion_tokens_details.reasoning_tokens > 0, on4.usage
            off = c.chat.completions.create(model=MODEL, messages=HI, max_completion_tokens=8, reasoning_effort="none")
            assert not off.usage.completion_tokens_details.reasoning_tokens and off.choices[0].message.content
            return "chat_template_kwargs thinking/enable_thinking, reasoning_effort, thinking field"

        def image():
            try:
                c.chat.completions.create(model=MODEL, max_completion_tokens=4, messages=[{"role": "user", "content": [
                    {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": IMAGE}}]}])
            except openai.BadRequestError as exc:
                assert "vision" in str(exc), exc
                return "400: " + exc.body["message"][:80]
            raise AssertionError("an image was accepted")

        def responses():
            r = c.responses.create(model=MODEL, input="Say hi", max_output_tokens=5)
            assert r.usage.output_tokens <= 5, r.usage
            return f"{r.usage.output_tokens} output tokens for max_output_tokens=5"

        def completions():
            r = c.completions.create(model=MODEL, prompt=["Hello", "The sea"], max_tokens=3, echo=True, logprobs=1)
            assert [ch.index for ch in r.choices] == [0, 1]
            assert r.choices[0].logprobs.token_logprobs[0] is None and len(r.choices[0].logprobs.tokens) > 1
            z = c.completions.create(model=MODEL, prompt="Hello there", max_tokens=0, echo=True, logprobs=1)
            assert z.usage.completion_tokens == 0 and z.choices[0].text == "Hello there"
            return "2 prompts, echo+logprobs, max_tokens=0 with echo"

        def tokenize():
            body = json.dumps({"prompt": "Hello there"}).encode()
            req = urllib.request.Request(f"{self.url}/tokenize", body, {"Content-Type": "application/json"})
            tokens = json.load(urllib.request.urlopen(req))["tokens"]
            req = urllib.request.Request(f"{self.url}/detokenize", json.dumps({"tokens": tokens}).encode(),
                                         {"Content-Type": "application/json"})
            assert json.load(urllib.request.urlopen(req))["prompt"].endswith("Hello there")
            return f"{len(tokens)} tokens, round trip"

        self.check(name, "max_completion_tokens (and precedence)", length)
        self.check(name, "no length field: sane default", default_length)
        self.check(name, "n=2", n2)
        self.check(name, "penalties, logit_bias, bad_words", penalties)
        self.check(name, "developer role", developer)
        self.check(name, "tool_choice required", tools_required)
        self.check(name, "named tool, streamed deltas", tools_named_stream)
        self.check(name, "tool_choice auto", tools_auto)
        self.check(name, "thinking switches", thinking)
        self.check(name, "image part refused (400)", image)
        self.check(name, "Responses max_output_tokens", responses)
        self.check(name, "completions batch/echo/logprobs", completions)
        self.check(name, "/tokenize /detokenize", tokenize)

    # -- anthropic SDK -----------------------------------------------------------------------------------------------
    def anthropic_sdk(self) -> None:
        import anthropic

        c = anthropic.Anthropic(base_url=self.url, api_key=KEY, max_retries=0)
        name = "anthropic SDK"

        def plain():
            r = c.messages.create(model=MODEL, max_tokens=8, messages=HI)
            kinds = [b.type for b in r.content]
            assert "thinking" not in kinds and r.usage.output_tokens <= 8, kinds
            return f"blocks {kinds}, {r.usage.output_tokens} output tokens"

        def thinking():
            r = c.messages.create(model=MODEL, max_tokens=1100, messages=HI,
                                  thinking={"type": "enabled", "budget_tokens": 1024})
            kinds = [b.type for b in r.content]
            assert kinds and kinds[0] == "thinking", kinds
            return f"blocks {kinds}"

        def tool():
            r = c.messages.create(model=MODEL, max_tokens=200, messages=[{"role": "user", "content": ASK}],
                                  tools=[{"name": "get_weather", "description": "The weather forecast",
                                          "input_schema": WEATHER}], tool_choice={"type": "any"})
            use = [b for b in r.content if b.type == "tool_use"]
            assert use and r.stop_reason == "tool_use"
            return f"tool_use {fits(use[0].input)}"

        def stream():
            with c.messages.stream(model=MODEL, max_tokens=6, messages=HI) as s:
                text = "".join(s.text_stream)
                final = s.get_final_message()
            assert final.usage.output_tokens <= 6
            return f"{len(text)} chars streamed"

        def image():
            try:
                c.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                 "data": IMAGE.split(",", 1)[1]}},
                    {"type": "text", "text": "What is this?"}]}])
            except anthropic.BadRequestError as exc:
                assert "vision" in str(exc), exc
                return "400"
            raise AssertionError("an image was accepted")

        self.check(name, "no thinking blocks unless asked", plain)
        self.check(name, "thinking blocks when asked", thinking)
        self.check(name, "forced tool_use", tool)
        self.check(name, "streaming", stream)
        self.check(name, "image part refused (400)", image)

    # -- langchain-openai --------------------------------------------------------------------------------------------
    def langchain(self) -> None:
        from langchain_core.messages import HumanMessage
        from langchain_openai import ChatOpenAI
        from pydantic import BaseModel, Field

        name = "langchain-openai"
        chat = ChatOpenAI(model=MODEL, base_url=f"{self.url}/v1", api_key=KEY, max_tokens=5, max_retries=0,
                          timeout=120)

        class Weather(BaseModel):
            """The weather request."""
            city: Literal["Paris", "Rome", "Oslo"]
            days: int = Field(ge=1, le=7)

        def invoke():
            r = chat.invoke("Write a poem about the sea.")
            n = r.usage_metadata["output_tokens"]
            assert n <= 5 and r.content, (n, r.content)
            return f"{n} tokens, content {r.content!r}"

        def stream():
            parts = [c.content for c in chat.stream("Write a poem about the sea.")]
            assert "".join(parts)
            return f"{len(parts)} chunks"

        def structured(method):
            def run():
                big = ChatOpenAI(model=MODEL, base_url=f"{self.url}/v1", api_key=KEY, max_tokens=200, max_retries=0,
                                 timeout=120)
                out = big.with_structured_output(Weather, method=method).invoke(ASK)
                assert isinstance(out, Weather)
                return repr(out)
            return run

        def bind(choice):
            def run():
                big = ChatOpenAI(model=MODEL, base_url=f"{self.url}/v1", api_key=KEY, max_tokens=200, max_retries=0,
                                 timeout=120)
                r = big.bind_tools([TOOL], tool_choice=choice).invoke(ASK)
                assert r.tool_calls and r.tool_calls[0]["name"] == "get_weather", r
                return f"args {fits(r.tool_calls[0]['args'])}"
            return run

        def n2():
            r = ChatOpenAI(model=MODEL, base_url=f"{self.url}/v1", api_key=KEY, max_tokens=4, n=2,
                           max_retries=0).generate([[HumanMessage("Hi")]])
            assert len(r.generations[0]) == 2
            return "2 generations"

        self.check(name, "invoke max_tokens (sent as max_completion_tokens)", invoke)
        self.check(name, "stream", stream)
        self.check(name, "structured output json_schema", structured("json_schema"))
        self.check(name, "structured output function_calling", structured("function_calling"))
        self.check(name, "bind_tools tool_choice=any", bind("any"))
        self.check(name, "bind_tools tool_choice=<name>", bind("get_weather"))
        self.check(name, "n=2", n2)

    # -- litellm -----------------------------------------------------------------------------------------------------
    def litellm(self) -> None:
        import litellm

        name = "litellm"
        kw = {"model": f"openai/{MODEL}", "api_base": f"{self.url}/v1", "api_key": KEY, "num_retries": 0}

        def length():
            r = litellm.completion(messages=HI, max_completion_tokens=5, **kw)
            assert r.usage.completion_tokens <= 5 and r.choices[0].message.content
            usage_adds_up(r.usage.model_dump())
            return f"{r.usage.completion_tokens} tokens"

        def n_penalties():
            r = litellm.completion(messages=HI, max_completion_tokens=4, n=2, presence_penalty=0.5,
                                   frequency_penalty=0.5, logit_bias={"100": -100}, seed=2, **kw)
            assert len(r.choices) == 2
            return "n=2 with penalties and logit_bias"

        def developer():
            r = litellm.completion(messages=[{"role": "developer", "content": "Be brief."}, *HI],
                                   max_completion_tokens=4, **kw)
            assert r.choices[0].message.content is not None
            return "200"

        def tool():
            r = litellm.completion(messages=[{"role": "user", "content": ASK}], tools=[TOOL], tool_choice="required",
                                   max_completion_tokens=200, **kw)
            call = r.choices[0].message.tool_calls[0]
            return f"arguments {fits(call.function.arguments)}"

        def stream():
            parts = [c.choices[0].delta.content or "" for c in
                     litellm.completion(messages=HI, max_completion_tokens=5, stream=True, **kw)]
            assert "".join(parts)
            return f"{len(parts)} chunks"

        self.check(name, "max_completion_tokens", length)
        self.check(name, "n, penalties, logit_bias", n_penalties)
        self.check(name, "developer role", developer)
        self.check(name, "tool_choice required", tool)
        self.check(name, "stream", stream)

    # -- HTTP: metrics and health ------------------------------------------------------------------------------------
    def http(self) -> None:
        name = "curl / Prometheus"

        def head():
            for path in ("/metrics", "/health"):
                req = urllib.request.Request(f"{self.url}{path}", method="HEAD")
                assert urllib.request.urlopen(req).status == 200, path
            return "200 on both"

        def vllm_names():
            text = urllib.request.urlopen(f"{self.url}/metrics").read().decode()
            wanted = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                      "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
                      "vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"]
            missing = [w for w in wanted if w not in text]
            assert not missing, missing
            return f"{len(wanted)} vllm: names present"

        self.check(name, "HEAD /metrics and /health", head)
        self.check(name, "vllm: metric names", vllm_names)

    # -- lm-eval (its own command) -----------------------------------------------------------------------------------
    def lm_eval(self, binary: str) -> None:
        root = Path(tempfile.mkdtemp(prefix="lmeval-"))
        tasks = write_tasks(root)
        for kind, path, task_names, extra in (
                ("local-completions", "/v1/completions", "ds_mc,ds_gen", ",tokenizer_backend=huggingface"),
                ("local-chat-completions", "/v1/chat/completions", "ds_gen", ",tokenizer_backend=none")):
            def run(kind=kind, path=path, task_names=task_names, extra=extra):
                out = root / kind
                cmd = [binary, "--model", kind, "--model_args",
                       f"model={MODEL},base_url={self.url}{path},tokenizer={EMBEDDED},num_concurrent=1,"
                       f"max_retries=1{extra}", "--tasks", task_names, "--include_path", str(tasks),
                       "--batch_size", "4" if kind == "local-completions" else "1", "--output_path", str(out),
                       "--log_samples"]
                if kind == "local-chat-completions":
                    cmd.append("--apply_chat_template")
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
                assert proc.returncode == 0, proc.stderr[-600:]
                samples = [json.loads(line) for f in out.rglob("samples_ds_gen*.jsonl") for line in f.open()]
                answers = [s["resps"][0][0] for s in samples]
                assert len(answers) == len(GEN), answers
                results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
                if kind == "local-chat-completions":
                    assert all(a.strip() for a in answers), f"empty answers: {answers}"
                summary = {t: {k: v for k, v in r.items() if k.endswith(",none") and "stderr" not in k}
                           for t, r in results.items()}
                return f"{summary}, generate_until answers {answers}"
            self.check(f"lm-eval {kind}", "loglikelihood MC + generate_until, batch 4" if kind == "local-completions"
                       else "generate_until, answers non-empty", run)


MC = [{"question": "The capital of France is", "choices": [" Paris", " Rome", " Oslo"], "answer": 0},
      {"question": "Two plus two is", "choices": [" four", " five"], "answer": 0},
      {"question": "The sky is", "choices": [" blue", " green", " loud"], "answer": 0},
      {"question": "Water is", "choices": [" wet", " dry"], "answer": 0},
      {"question": "Fire is", "choices": [" hot", " cold"], "answer": 1}]
GEN = [{"question": "Q: What is 1 + 1?\nA:", "answer": " 2"}, {"question": "Q: Name a colour.\nA:", "answer": " red"}]


def write_tasks(root: Path) -> Path:
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in MC))
    (tasks / "gen.jsonl").write_text("".join(json.dumps(d) + "\n" for d in GEN))
    common = "dataset_path: json\ntest_split: test\ndoc_to_text: \"{{question}}\"\n"
    (tasks / "ds_mc.yaml").write_text(
        f"task: ds_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {tasks / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{answer}}\"\n"
        "metric_list:\n  - metric: acc\n")
    (tasks / "ds_gen.yaml").write_text(
        f"task: ds_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {tasks / 'gen.jsonl'}\n"
        "output_type: generate_until\ndoc_to_target: \"{{answer}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 6\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")
    return tasks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--lm-eval", help="lm_eval executable (a side venv); without it lm-eval is not run")
    parser.add_argument("--only", help="comma-separated: openai,anthropic,langchain,litellm,http,lmeval")
    args = parser.parse_args()
    audit = Audit(args.url.rstrip("/"))
    parts = {"openai": audit.openai_sdk, "anthropic": audit.anthropic_sdk, "langchain": audit.langchain,
             "litellm": audit.litellm, "http": audit.http}
    if args.lm_eval:
        parts["lmeval"] = lambda: audit.lm_eval(args.lm_eval)
    chosen = args.only.split(",") if args.only else list(parts)
    for key in chosen:
        parts[key]()
    print("\n| client | feature | result | detail |\n| --- | --- | --- | --- |")
    for row in audit.rows:
        print(f"| {row['client']} | {row['feature']} | {'works' if row['works'] else 'FAILS'} | "
              f"{row['detail'].replace('|', '/')} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"url": args.url, "rows": audit.rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
