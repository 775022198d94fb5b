"""Every hook a deepserve plugin can implement, in one place.

A plugin is a module (or any object) with functions decorated by `hookimpl` whose names match a spec below.
Built-in parts are plugins too (`deepserve.core.plugins.DEFAULT_PLUGINS`); third-party packages register
through the `deepserve` entry-point group. Hooks are called when the engine starts (or once per finished
request, off the step loop), never per step: the engine resolves them into plain objects at start-up.

Two styles:
- "one winner" (`firstresult`): the first implementation that returns something other than None wins, the
  rest are not called. Implementations are called newest-registered first; `tryfirst`/`trylast` move them.
- "contribute named things": the hook receives a `register(name, factory)` callback and calls it once per
  thing it adds. Factories are called later, when the thing is chosen, so heavy imports belong inside them.

Docstring template (as in pytest): when the hook is called, each parameter, what to return.
"""

from __future__ import annotations

from typing import Any, Callable

import pluggy

from deepserve.core.config import EngineConfig
from deepserve.core.interfaces import Backend

PROJECT = "deepserve"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

#: the callback a `deepserve_register_*` hook receives: `register(name, factory)`
Register = Callable[[str, Callable[..., Any]], None]


@hookspec(firstresult=True)
def deepserve_select_backend(config: EngineConfig) -> Backend | None:
    """Choose the accelerator backend that runs the model's ops; first non-None wins.

    Called once when the engine starts, through `deepserve.core.plugins.select_backend`.

    :param config: the engine's options. `config.accelerator` is already resolved from the environment
        (`DEEPSERVE_ACCELERATOR`): `auto`, `cpu`, `nvidia`, `ascend` or a third-party backend's name.
        `config.device` optionally pins a torch device.
    :return: a `deepserve.core.interfaces.Backend` instance if this plugin serves `config.accelerator`, else
        None to pass. When the accelerator is asked for by name but cannot run here, raise
        `deepserve.core.interfaces.BackendUnavailable` saying what is missing instead of returning None.
        On `auto`, answer only if your hardware is present; the reference backend answers last.
    """


@hookspec
def deepserve_register_cache_backends(register: Register) -> None:
    """Contribute block stores for KV blocks beyond the GPU's pages (host memory, a 3FS directory, Redis, ...),
    each by the URI scheme it serves.

    Called once when an engine is built (`deepserve.build.build_engine`), through
    `deepserve.core.plugins.collect_registrations`; the engine keeps the factories in a
    `deepserve.core.kv.store.StoreRegistry`, which opens a store when a URI names its scheme (`kv_store`,
    `--kv-store`). The built-in `deepserve.plugins.cache.plugin` registers `memory`, `dir`, `redis`, `rediss`,
    `ec` and `mooncake` (docs/cache.md).

    :param register: call `register(scheme, factory)` once per store; `scheme` is the URI scheme it serves
        (`dir` for `dir:///mnt/3fs/kv`) and must be unique across all plugins; `factory(uri)` takes the whole
        URI and returns a `deepserve.core.kv.store.BlockStore` (raise ValueError naming what is wrong with a
        malformed URI). It is called only when that store is chosen, so heavy imports belong inside it. A
        composite store (one over child stores, as `ec` is) may take a keyword `registry=`: the registry then
        passes itself, to open the children by their URIs.
    :return: nothing.
    """


@hookspec
def deepserve_register_grammar_backends(register: Register) -> None:
    """Contribute structured-output grammar backends (JSON schema, regex, grammar, choice -> token masks).

    Called once when the engine starts, through `deepserve.core.plugins.collect_registrations`; the engine's
    `GrammarCompiler` keeps the factories. The built-in `deepserve.plugins.structured.plugin` registers
    `llguidance` (the default).

    :param register: call `register(name, factory)` once per backend; `name` is unique across all plugins and
        is what users select it by: the engine option `structured_outputs_backend` (the server's
        `--structured-outputs-backend`), or per request `structured_outputs={"backend": name, ...}` (over HTTP
        also `guided_decoding_backend`). `factory(tokenizer_info)` takes a
        `deepserve.core.structured.TokenizerInfo` and returns a `deepserve.core.structured.GrammarBackend`; it is
        called once per engine, on a compile thread, when the backend is first used (the default one at
        start-up), so heavy imports belong inside it. `GrammarBackend.compile` runs on compile threads and raises
        `deepserve.core.structured.GrammarError` naming what is wrong with the user's spec: the server answers
        that message as a 400.
    :return: nothing.
    """


@hookspec
def deepserve_register_proposers(register: Register) -> None:
    """Contribute speculative-decoding drafters (e.g. DSpark, MTP) and their verify planners.

    Called once when the engine starts, through `deepserve.core.plugins.collect_registrations`.

    :param register: call `register(name, factory)` once per proposer; `name` is unique across all plugins and
        is what `speculative_config={"method": name}` selects (built-in: `mtp`, `dspark`). `factory(model=...,
        config=..., model_dir=...)` is called once at start-up when the engine is configured to use it, with
        the loaded `DeepseekV4ForCausalLM`, the `deepserve.core.config.SpeculativeConfig` and the checkpoint
        directory, and returns a `deepserve.model.speculative.Proposer` (heavy imports belong inside it).
    :return: nothing.
    """


@hookspec
def deepserve_register_expert_transports(register: Register) -> None:
    """Contribute expert-parallel transports: how routed tokens reach the ranks holding their experts and come
    back (torch.distributed all-to-all, DeepEP, ...).

    Called once in each rank process when an engine with `enable_expert_parallel` is built
    (`deepserve.build.build_engine`), through `deepserve.core.plugins.collect_registrations`. The built-in
    `deepserve.plugins.transports.plugin` registers `all_to_all`.

    :param register: call `register(name, factory)` once per transport; `name` is unique across all plugins and
        is what the engine option `expert_transport` (`--expert-transport`) selects. `factory(group, placement,
        experts)` receives the ranks' `torch.distributed` process group, the
        `deepserve.distributed.placement.ExpertPlacement` and this rank's `deepserve.distributed.transport.LocalExperts`,
        and returns a `deepserve.distributed.transport.ExpertTransport` (its docstring states the contract:
        ranks may be at different MoE sites in one exchange). Heavy imports (`deep_ep`) belong inside it; raise
        `RuntimeError` saying what is missing when it cannot run here.
    :return: nothing.
    """


@hookspec
def deepserve_register_dp_routers(register: Register) -> None:
    """Contribute routing policies for the data-parallel front: which rank serves each new request.

    Called once when a front with `data_parallel_size` ranks is built (`deepserve.build.build_engine`), through
    `deepserve.core.plugins.collect_registrations`. The built-in `deepserve.plugins.routers.plugin` registers
    `least_loaded` (the default).

    :param register: call `register(name, factory)` once per policy; `name` is unique across all plugins and is
        what the engine option `data_parallel_router` (`--data-parallel-router`) selects. `factory(world_size)`
        returns a `deepserve.distributed.router.Router`, whose `choose(request_id, prompt_token_ids, loads)` is
        called on the front's engine thread once per request and returns a rank.
    :return: nothing.
    """


@hookspec
def deepserve_register_routes(register: Register) -> None:
    """Contribute extra HTTP routes to the server.

    Called once when the server's app is built, through `deepserve.core.plugins.collect_registrations`.

    :param register: call `register(name, factory)` once per route; `name` is unique across all plugins,
        `factory` is called with the app being built and adds the route to it.
    :return: nothing.
    """


@hookspec
def deepserve_request_finished(request: Any, stats: Any) -> None:
    """Observe a request that has finished (completed, stopped, aborted or failed): accounting, logging.

    Called once per finished request, on the asyncio side after its last output, never inside the step loop.
    Every implementation is called.

    :param request: the finished request (its id, sampling parameters and token counts); read it, do not
        change it.
    :param stats: the request's final numbers (prompt, cached and output tokens, timings), read-only.
    :return: nothing. Return quickly: hand slow work (network, disk) to a task or a thread.
    """
