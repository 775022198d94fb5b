"""The `deepserve` command: `deepserve generate` (offline generation) and `deepserve plugins` (what is loaded).
`deepserve serve` arrives with the server issue."""

from __future__ import annotations

import argparse
import json
import sys


def _generate(args: argparse.Namespace) -> int:
    from deepserve import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, accelerator=args.accelerator, max_model_len=args.max_model_len)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                            seed=args.seed, stop=args.stop or None)
    for out in llm.generate(args.prompt, params, use_tqdm=False):
        completion = out.outputs[0]
        print(json.dumps({"prompt": out.prompt, "text": completion.text, "token_ids": completion.token_ids,
                          "finish_reason": completion.finish_reason}, ensure_ascii=False))
    return 0


def _plugins(args: argparse.Namespace) -> int:
    from deepserve.core.plugins import list_plugins, make_plugin_manager

    for info in list_plugins(make_plugin_manager(load_entrypoints=not args.builtin_only)):
        origin = f"{info.dist} {info.version}" if info.dist else info.source
        print(f"{info.name}  ({origin})  hooks: {', '.join(info.hooks)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepserve", description="Inference server for DeepSeek-V4 models")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions for prompts, one JSON line each")
    gen.add_argument("prompt", nargs="+", help="prompt text (one or more)")
    gen.add_argument("--model", default=None, help="checkpoint directory (default: $DEEPSERVE_MODEL)")
    gen.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    gen.add_argument("--accelerator", default="auto", help="auto, cpu, nvidia, ascend or a plugin's backend")
    gen.add_argument("--max-model-len", type=int, default=None)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="a stop string (repeatable)")
    gen.set_defaults(func=_generate)
    plug = sub.add_parser("plugins", help="list the plugins that load, and the hooks each implements")
    plug.add_argument("--builtin-only", action="store_true", help="skip third-party entry points")
    plug.set_defaults(func=_plugins)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:  # bad input: one clear line, no traceback
        print(f"deepserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
