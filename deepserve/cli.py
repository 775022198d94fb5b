"""The `deepserve` command: `deepserve serve` (the HTTP server), `deepserve generate` (offline generation) and
`deepserve plugins` (what is loaded)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

#: the embedded default model `serve` uses when no model is named (its own issue builds it)


def _generate(args: argparse.Namespace) -> int:
    from deepserve import LLM, SamplingParams

    from deepserve.core.config import SpeculativeConfig

    llm = LLM(args.model, dtype=args.dtype, accelerator=args.accelerator, max_model_len=args.max_model_len,
              speculative_config=SpeculativeConfig.parse(args.speculative_config), quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                            seed=args.seed, stop=args.stop or None)
    for out in llm.generate(args.prompt, params, use_tqdm=False):
        completion = out.outputs[0]
        print(json.dumps({"prompt": out.prompt, "text": completion.text, "token_ids": completion.token_ids,
                          "finish_reason": completion.finish_reason}, ensure_ascii=False))
    return 0


def default_model() -> str:
    """The model `serve` uses when none is named: $DEEPSERVE_MODEL, else the embedded default model."""
    from deepserve.core.env import default_model_dir

    model = default_model_dir()
    if model is None:
        raise ValueError("no model given and the embedded default model is not installed: pass a checkpoint "
                         "directory (deepserve serve MODEL_DIR) or set DEEPSERVE_MODEL; `python -m "
                         "deepserve.tools.demo_checkpoint DIR` writes a small random one")
    return model


def engine_options(args: argparse.Namespace) -> dict:
    """The `LLM` options `deepserve serve` builds its engine with (validated: a bad value raises ValueError)."""
    from deepserve.core.config import SpeculativeConfig

    engine_kwargs = dict(dtype=args.dtype, accelerator=args.accelerator, max_model_len=args.max_model_len,
                         max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                         block_size=args.block_size, enable_prefix_caching=not args.no_prefix_caching,
                         gpu_memory_utilization=args.gpu_memory_utilization, seed=args.seed,
                         enforce_eager=args.enforce_eager, quantization=args.quantization,
                         kv_cache_dtype=args.kv_cache_dtype, generation_config=args.generation_config)
    if args.cuda_graph_sizes is not None:
        engine_kwargs["cuda_graph_sizes"] = args.cuda_graph_sizes
    if args.skip_warm_up:  # else the engine's default: warm up on every device but the CPU
        engine_kwargs["warm_up"] = False
    if args.batch_invariant:  # else DEEPSERVE_BATCH_INVARIANT, else each backend's default
        engine_kwargs["batch_invariant"] = True
    if args.kv_cache_bytes is not None:
        engine_kwargs["kv_cache_bytes"] = args.kv_cache_bytes
    for name in ("host_cache_bytes", "kv_store", "kv_store_deadline", "kv_store_ttl_class",  # docs/cache.md
                 "kv_events_config", "swa_host_slots", "swa_replay"):
        if getattr(args, name) is not None:
            engine_kwargs[name] = getattr(args, name)
    if args.kv_store_snapshots is not None:
        engine_kwargs["kv_store_snapshots"] = args.kv_store_snapshots
    if args.engram_device is not None:  # docs/v41.md
        engine_kwargs["engram_device"] = args.engram_device
    if args.speculative_config is not None:  # else LLM reads DEEPSERVE_SPECULATIVE_CONFIG
        engine_kwargs["speculative_config"] = SpeculativeConfig.parse(args.speculative_config)
    for name in SCALE_OUT_OPTIONS:  # docs/distributed.md
        if getattr(args, name) is not None:
            engine_kwargs[name] = getattr(args, name)
    if args.enable_expert_parallel:
        engine_kwargs["enable_expert_parallel"] = True
    if args.enable_eplb:
        engine_kwargs["enable_eplb"] = True
    if args.engine_process is not None:  # else DEEPSERVE_ENGINE_PROCESS, else in this process
        engine_kwargs["engine_process"] = args.engine_process
    return engine_kwargs


#: `deepserve serve` flags that pass to the engine as they are, when given (vLLM's names)
SCALE_OUT_OPTIONS = ("tensor_parallel_size", "data_parallel_size", "data_parallel_size_local",
                     "data_parallel_start_rank", "data_parallel_address", "data_parallel_rpc_port",
                     "data_parallel_router", "data_parallel_timeout", "num_redundant_experts", "expert_placement",
                     "expert_transport", "eplb_window_size", "eplb_step_interval")


def thinking_default(args: argparse.Namespace) -> bool:
    """The server's thinking mode: `--thinking on|off`, or vLLM's `--default-chat-template-kwargs '{"thinking":
    true}'` (`enable_thinking` too), which must agree when both are given; off when neither is."""
    from deepserve.server.dialects import thinking_switch

    flag = None if args.thinking is None else args.thinking == "on"
    kwargs = None
    if args.default_chat_template_kwargs is not None:
        try:
            kwargs = json.loads(args.default_chat_template_kwargs)
        except ValueError as exc:
            raise ValueError(f"--default-chat-template-kwargs is not JSON: {exc}") from None
        if not isinstance(kwargs, dict):
            raise ValueError("--default-chat-template-kwargs must be a JSON object, e.g. '{\"thinking\": true}'")
        kwargs = thinking_switch(kwargs, "--default-chat-template-kwargs")
    if flag is not None and kwargs is not None and flag != kwargs:
        raise ValueError(f"--thinking {args.thinking} and --default-chat-template-kwargs disagree")
    return next((mode for mode in (flag, kwargs) if mode is not None), False)


def _serve(args: argparse.Namespace) -> int:
    from deepserve.core.env import env_value
    from deepserve.server import ServerConfig, run_server

    model = args.model or default_model()
    if not Path(model).is_dir():
        raise FileNotFoundError(f"model directory {model} does not exist")
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="%(asctime)s %(levelname)s %(message)s")
    engine_kwargs = engine_options(args)
    from deepserve.build import resolve_config, run_headless

    engine_config = resolve_config(model, **engine_kwargs)  # refuses impossible options before anything starts
    if args.headless:  # this machine's ranks only; the front (and the API) run on the machine they connect to
        run_headless(engine_config)
        return 0
    config = ServerConfig(model=model, served_model_name=args.served_model_name,
                          api_key=args.api_key or env_value("DEEPSERVE_API_KEY") or None,
                          max_waiting_requests=args.max_waiting_requests, max_body_bytes=args.max_body_bytes,
                          drain_timeout=args.drain_timeout, engine_step_timeout=args.engine_step_timeout,
                          default_thinking_mode=thinking_default(args),
                          structured_outputs_backend=args.structured_outputs_backend,
                          grammar_compile_timeout=args.grammar_compile_timeout,
                          default_max_tokens=args.default_max_tokens, stream_interval=args.stream_interval,
                          engine_kwargs=engine_kwargs)
    run_server(config, args.host, args.port)
    return 0


def _add_scale_out_flags(serve: argparse.ArgumentParser) -> None:
    """vLLM's data- and expert-parallel flags (docs/distributed.md)."""
    group = serve.add_argument_group("scale-out (docs/distributed.md)")
    group.add_argument("--tensor-parallel-size", "-tp", type=int, default=None,
                       help="refused above 1: V4's attention has one KV head; use --data-parallel-size")
    group.add_argument("--data-parallel-size", "-dp", type=int, default=None,
                       help="engine ranks, one process each (attention data-parallel)")
    group.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                       help="run the engine in a process of its own behind a front, so that the server's Python "
                       "does not share its GIL (vLLM's multiprocessing engine core; default: "
                       "$DEEPSERVE_ENGINE_PROCESS, else off)")
    group.add_argument("--enable-expert-parallel", action="store_true",
                       help="shard the routed experts over the ranks (the MoE expert-parallel)")
    group.add_argument("--data-parallel-size-local", type=int, default=None,
                       help="ranks started on this machine (default: all)")
    group.add_argument("--data-parallel-start-rank", type=int, default=None,
                       help="the first rank this machine starts (multi-node)")
    group.add_argument("--data-parallel-address", default=None,
                       help="where every node meets: the front's host (default 127.0.0.1)")
    group.add_argument("--data-parallel-rpc-port", type=int, default=None,
                       help="the front's ZMQ port; the torch.distributed rendezvous is the next one")
    group.add_argument("--headless", action="store_true",
                       help="start this machine's ranks only, for a front on --data-parallel-address")
    group.add_argument("--data-parallel-router", default=None, help="the front's routing policy plugin "
                       "(default least_loaded)")
    group.add_argument("--data-parallel-timeout", type=float, default=None,
                       help="seconds a rank's start or one collective may take before the ranks stop (default 120)")
    group.add_argument("--num-redundant-experts", type=int, default=None,
                       help="extra expert slots holding copies of experts (expert parallelism)")
    group.add_argument("--expert-placement", default=None, metavar="JSON",
                       help="a phy2log table [sites][physical slots] (EPLB's output) instead of the static one")
    group.add_argument("--expert-transport", default=None, help="the expert-parallel transport plugin "
                       "(default all_to_all)")
    group.add_argument("--enable-eplb", action="store_true",
                       help="reassign experts while serving by DeepSeek's EPLB over recent expert loads")
    group.add_argument("--eplb-window-size", type=int, default=None, help="steps of counts EPLB places by (100)")
    group.add_argument("--eplb-step-interval", type=int, default=None, help="steps between reassignments (1000)")


def _add_serve_parser(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="serve the OpenAI and Anthropic HTTP APIs (aiohttp on uvloop)")
    serve.add_argument("model", nargs="?", default=None,
                       help="checkpoint directory (default: $DEEPSERVE_MODEL, else the embedded default model)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require this key on /v1 routes (default: $DEEPSERVE_API_KEY)")
    serve.add_argument("--served-model-name", default=None, help="the name clients send (default: the directory's)")
    serve.add_argument("--max-model-len", type=int, default=None)
    serve.add_argument("--max-num-seqs", type=int, default=256, help="requests the engine runs at once")
    serve.add_argument("--max-waiting-requests", type=int, default=128,
                       help="requests that may wait beyond --max-num-seqs; more get 429")
    serve.add_argument("--max-num-batched-tokens", type=int, default=8192)
    serve.add_argument("--block-size", type=int, default=256, help="KV cache page size in tokens")
    serve.add_argument("--kv-cache-bytes", type=int, default=None, help="KV cache budget (default: CPU 512 MiB, "
                       "GPU --gpu-memory-utilization)")
    serve.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    serve.add_argument("--host-cache-bytes", type=int, default=None,
                       help="a host-memory tier of KV blocks below the GPU pages, LRU past this many bytes")
    serve.add_argument("--kv-store", default=None, metavar="URI",
                       help="a shared block store below the host tier: dir:///mnt/3fs/kv, redis://host:6379/0, "
                       "ec:10+2:dir:///root (docs/cache.md)")
    serve.add_argument("--kv-store-deadline", type=float, default=None,
                       help="seconds a block-store call may take before it counts as a miss (default 1)")
    serve.add_argument("--kv-store-ttl-class", default=None, choices=["chat", "agent"],
                       help="retention class of the blocks written by requests without a cache_ttl field of their "
                       "own: chat (7 days, the default) or agent (3 days)")
    serve.add_argument("--swa-host-slots", type=int, default=None, metavar="N",
                       help="keep the window state past the last full page of N finished sequences in host "
                       "slots (MXFP8) for their next turn (docs/cache.md)")
    serve.add_argument("--no-kv-store-snapshots", dest="kv_store_snapshots", action="store_false", default=None,
                       help="store only the compressed KV pools, not the page-boundary window snapshots; a prefix "
                       "from the store then replays its window state (--swa-replay)")
    serve.add_argument("--swa-replay", default=None, choices=["exact", "bounded"],
                       help="how a prefix whose window snapshot is not stored gets it back: exact (window x depth "
                       "tokens, the default) or bounded (the last 128 tokens, attending within them)")
    serve.add_argument("--kv-events-config", default=None, metavar="JSON",
                       help='publish KV cache events for routers, as vLLM does: \'{"enable_kv_cache_events": true, '
                       '"endpoint": "tcp://*:5557"}\'')
    serve.add_argument("--no-prefix-caching", action="store_true")
    serve.add_argument("--engram-device", default=None, choices=["cpu"],
                       help="DeepSeek-V4.1: keep the Engram tables in host memory whatever device the model runs "
                       "on (docs/v41.md)")
    _add_scale_out_flags(serve)
    serve.add_argument("--enforce-eager", action="store_true",
                       help="launch every decode step's kernels one by one instead of replaying CUDA graphs")
    serve.add_argument("--cuda-graph-sizes", type=int, nargs="+", default=None, metavar="N",
                       help="decode batch sizes captured as CUDA graphs at start-up (default 1 2 4 8 12 16 24 32 "
                       "48 ... up to --max-num-seqs); larger steps run without a graph")
    serve.add_argument("--generation-config", default="auto",
                       help="the sampling defaults of requests that leave a field out: 'auto' (the model's "
                            "generation_config.json), 'vllm' (ignore it: temperature 1, no penalties), or a folder "
                            "holding a generation_config.json (default: auto)")
    serve.add_argument("--skip-warm-up", "--skip-server-warmup", dest="skip_warm_up", action="store_true",
                       help="serve without first running every kind of step once (prompt chunks of each size, "
                       "prefix, mixed and verify steps) to compile their kernels: a faster start, and the first "
                       "requests of each shape then pay the compiles (SGLang's name is accepted too)")
    serve.add_argument("--batch-invariant", action="store_true",
                       help="outputs that do not depend on the batch (fixed reduction orders; slower on NVIDIA)")
    serve.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    serve.add_argument("--quantization", "-q", default="auto", choices=["auto", "fp8", "none"],
                       help="auto: weights stay FP8/FP4 as the checkpoint's quantization_config stores them; fp8: "
                       "DeepSeek's FP8 dense + FP4 experts (a bf16 checkpoint is quantized at load); none: bf16")
    serve.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bf16", "fp8"],
                       help="auto: the KV cache at the model dtype; fp8: DeepSeek's reference precision (FP8 "
                       "non-RoPE dims with power-of-two scales per 64, bf16 RoPE dims, FP4 indexer keys)")
    serve.add_argument("--accelerator", default="auto", help="auto, cpu, nvidia, ascend or a plugin's backend")
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--thinking", choices=["on", "off"], default=None,
                       help="thinking mode for chat and Responses requests that do not choose (default: off)")
    serve.add_argument("--default-chat-template-kwargs", default=None,
                       help='vLLM\'s spelling of --thinking: \'{"thinking": true}\' (or "enable_thinking"); other '
                       "keys are not read")
    serve.add_argument("--default-max-tokens", type=int, default=4096,
                       help="output limit of a chat or Responses request that sets none, lowered to the context "
                       "the prompt leaves (default: 4096)")
    serve.add_argument("--stream-interval", type=int, default=1,
                       help="output tokens per streamed chunk (SGLang's): the first token and the end are sent at "
                       "once, the rest every N tokens; larger values cost the server less per token (default: 1)")
    serve.add_argument("--structured-outputs-backend", default=None,
                       help="grammar backend plugin for constrained requests that name none (default: llguidance)")
    serve.add_argument("--grammar-compile-timeout", type=float, default=None,
                       help="seconds a request's structured-output constraint may take to compile; past it: 400 "
                       "(default: 10)")
    serve.add_argument("--speculative-config", default=None,
                       help='speculative decoding as JSON, e.g. \'{"method": "dspark", "num_speculative_tokens": 5}\' '
                       '(methods: mtp = fixed-k MTP drafts, dspark = confidence-planned verify lengths; default: '
                       '$DEEPSERVE_SPECULATIVE_CONFIG, else off)')
    serve.add_argument("--max-body-bytes", type=int, default=16 * 2**20, help="larger request bodies get 413")
    serve.add_argument("--drain-timeout", type=float, default=30.0,
                       help="seconds in-flight requests get to finish on shutdown; then open streams end with "
                       "the protocol's error event")
    serve.add_argument("--engine-step-timeout", type=float, default=60.0,
                       help="seconds the engine may go without completing a step while it has work before "
                       "/health answers 503 (logged)")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.set_defaults(func=_serve)


def _plugins(args: argparse.Namespace) -> int:
    from deepserve.core.plugins import list_plugins, make_plugin_manager

    for info in list_plugins(make_plugin_manager(load_entrypoints=not args.builtin_only)):
        origin = f"{info.dist} {info.version}" if info.dist else info.source
        print(f"{info.name}  ({origin})  hooks: {', '.join(info.hooks)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepserve", description="Inference server for DeepSeek-V4 models")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve_parser(sub)
    gen = sub.add_parser("generate", help="generate completions for prompts, one JSON line each")
    gen.add_argument("prompt", nargs="+", help="prompt text (one or more)")
    gen.add_argument("--model", default=None, help="checkpoint directory (default: $DEEPSERVE_MODEL)")
    gen.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    gen.add_argument("--quantization", "-q", default="auto", choices=["auto", "fp8", "none"],
                       help="auto: weights stay FP8/FP4 as the checkpoint's quantization_config stores them; fp8: "
                       "DeepSeek's FP8 dense + FP4 experts (a bf16 checkpoint is quantized at load); none: bf16")
    gen.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bf16", "fp8"],
                       help="auto: the KV cache at the model dtype; fp8: DeepSeek's reference precision (FP8 "
                       "non-RoPE dims with power-of-two scales per 64, bf16 RoPE dims, FP4 indexer keys)")
    gen.add_argument("--accelerator", default="auto", help="auto, cpu, nvidia, ascend or a plugin's backend")
    gen.add_argument("--max-model-len", type=int, default=None)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="a stop string (repeatable)")
    gen.add_argument("--speculative-config", default=None, help="speculative decoding as JSON (see serve --help)")
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
