"""The plugin manager factory and the start-up helpers that turn hook answers into plain objects.

`make_plugin_manager()` builds a fresh `pluggy.PluginManager` (there is no global one): built-in plugins from
`DEFAULT_PLUGINS` first, then third-party packages from the `deepserve` entry-point group (narrowed by the
`DEEPSERVE_PLUGINS` allowlist), then any plugin objects passed in. The engine calls `select_backend` and
`collect_registrations` once at start-up and keeps what they return; nothing here runs per step.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pluggy

from deepserve.core import hookspecs
from deepserve.core.config import EngineConfig
from deepserve.core.env import env_value
from deepserve.core.interfaces import Backend, BackendUnavailable

ENTRYPOINT_GROUP = "deepserve"

#: built-in plugins, registered by module name before any third-party one
DEFAULT_PLUGINS: list[str] = [
    "deepserve.backends.reference.plugin",
    "deepserve.backends.nvidia.plugin",
    "deepserve.backends.ascend.plugin",
    "deepserve.plugins.structured.plugin",
    "deepserve.plugins.speculative.plugin",
    "deepserve.plugins.cache.plugin",
    "deepserve.plugins.transports.plugin",
    "deepserve.plugins.routers.plugin",
]

#: accelerator names the built-in backend plugins answer to
BUILTIN_ACCELERATORS = ("auto", "cpu", "nvidia", "ascend")

REGISTER_HOOKS = tuple(name for name in dir(hookspecs) if name.startswith("deepserve_register_"))


class PluginError(RuntimeError):
    """A plugin failed to load or broke a hook's contract; the message names the plugin and the problem."""


@dataclass(frozen=True, slots=True)
class PluginInfo:
    """One registered plugin, as `deepserve plugins` lists it."""

    name: str  # the name it is registered under (module path, or entry-point name)
    module: str  # where its code lives
    source: str  # "built-in", "entry point" or "passed in"
    dist: str | None  # the distribution that declared its entry point
    version: str | None
    hooks: tuple[str, ...]  # the hooks it implements


def make_plugin_manager(load_entrypoints: bool = True, plugins: Iterable[object] = ()) -> pluggy.PluginManager:
    """A new plugin manager with the built-in plugins, the allowed third-party plugins, then `plugins`.

    Tests pass `load_entrypoints=False` and their fakes in `plugins`, so nothing installed on the machine
    leaks in and nothing stays registered after the test. Raises `pluggy.PluginValidationError` when a
    plugin implements a hook that does not exist (a misspelt name) and `PluginError` when an entry point
    fails to import.
    """
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    for module_name in DEFAULT_PLUGINS:
        pm.register(importlib.import_module(module_name), name=module_name)
    if load_entrypoints:
        _load_entrypoint_plugins(pm, _allowlist())
    for plugin in plugins:
        pm.register(plugin)
    pm.check_pending()
    return pm


def _canonical(name: str) -> str:
    """Distribution-name normalisation (PEP 503), so `My_Plugin` in the allowlist matches `my-plugin`."""
    return re.sub(r"[-_.]+", "-", name.strip()).lower()


def _allowlist() -> set[str] | None:
    raw = env_value("DEEPSERVE_PLUGINS")
    if raw is None:
        return None
    return {_canonical(name) for name in raw.split(",") if name.strip()}


def _load_entrypoint_plugins(pm: pluggy.PluginManager, allowed: set[str] | None) -> None:
    # Entry points outside the allowlist are blocked for the duration of pluggy's own loader, which skips
    # blocked names; pluggy then records each loaded plugin's distribution for `list_plugins`.
    refused = []
    if allowed is not None:
        for ep in importlib.metadata.entry_points(group=ENTRYPOINT_GROUP):
            dist = ep.dist.name if ep.dist is not None else ""
            if _canonical(ep.name) not in allowed and _canonical(dist) not in allowed and not pm.has_plugin(ep.name):
                pm.set_blocked(ep.name)
                refused.append(ep.name)
    try:
        pm.load_setuptools_entrypoints(ENTRYPOINT_GROUP)
    except Exception as exc:
        raise PluginError(
            f"loading third-party plugins from entry-point group {ENTRYPOINT_GROUP!r} failed: {exc!r} "
            "(DEEPSERVE_PLUGINS=name,... loads only the plugins named)"
        ) from exc
    finally:
        for name in refused:
            pm.unblock(name)


def _label(name: str) -> str:
    return "an unnamed plugin object" if name.isdigit() else repr(name)  # pluggy names bare objects by id()


def collect_registrations(pm: pluggy.PluginManager, hook_name: str) -> dict[str, Callable[..., Any]]:
    """Call the `deepserve_register_*` hook `hook_name` and return what the plugins registered, name -> factory.

    Raises `PluginError` when two plugins register the same name (naming both), or a plugin registers
    something that is not callable or a name that is not a non-empty string.
    """
    if hook_name not in REGISTER_HOOKS:
        raise PluginError(f"{hook_name!r} is not a register hook; the register hooks are {list(REGISTER_HOOKS)}")
    entries: dict[str, tuple[str, Callable[..., Any]]] = {}
    # Each implementation is called here, in pluggy's order, rather than through `pm.hook`, so that the
    # callback knows which plugin is registering and an error can name it.
    for impl in reversed(getattr(pm.hook, hook_name).get_hookimpls()):
        if impl.hookwrapper or impl.wrapper:
            raise PluginError(f"plugin {_label(impl.plugin_name)} wraps {hook_name}; register hooks take no wrappers")
        register = _registrar(entries, hook_name, impl.plugin_name)
        impl.function(**{arg: register for arg in impl.argnames})
    return {name: factory for name, (_, factory) in entries.items()}


def _registrar(entries: dict[str, tuple[str, Callable[..., Any]]], hook_name: str, owner: str) -> hookspecs.Register:
    def register(name: str, factory: Callable[..., Any]) -> None:
        where = f"plugin {_label(owner)} in {hook_name}"
        if not isinstance(name, str) or not name:
            raise PluginError(f"{where} registered the name {name!r}; names must be non-empty strings")
        if not callable(factory):
            raise PluginError(
                f"{where} registered {name!r} as a {type(factory).__name__}, which is not callable; "
                "register a factory (a class or a function) that builds it"
            )
        if name in entries:
            raise PluginError(
                f"{name!r} is registered twice in {hook_name}: by plugin {_label(entries[name][0])} and by "
                f"plugin {_label(owner)}; uninstall one, or leave one out of DEEPSERVE_PLUGINS"
            )
        entries[name] = (owner, factory)

    return register


def resolve_accelerator(config: EngineConfig) -> str:
    """The accelerator to run on: an explicit (non-`auto`) `config.accelerator` wins, then
    `DEEPSERVE_ACCELERATOR` (or DeepInfer's `DEEPINFER_ACCELERATOR`), then `auto`."""
    if config.accelerator != "auto":
        return config.accelerator
    forced = (env_value("DEEPSERVE_ACCELERATOR") or "").strip().lower()
    return forced or "auto"


def select_backend(pm: pluggy.PluginManager, config: EngineConfig) -> Backend:
    """Ask the plugins for the backend serving `config` (accelerator resolved by `resolve_accelerator`).

    Raises `BackendUnavailable` when no plugin answers (naming the accelerator asked for and the choices),
    or whatever a plugin raises for an accelerator it owns but cannot run here; raises `PluginError` when
    the answer is not a `Backend`. `config` itself is not changed.
    """
    accelerator = resolve_accelerator(config)
    if accelerator != config.accelerator:
        config = dataclasses.replace(config, accelerator=accelerator)
    backend = pm.hook.deepserve_select_backend(config=config)
    if backend is None:
        others = [_label(name) for name, p in pm.list_name_plugin() if p is not None and name not in DEFAULT_PLUGINS]
        raise BackendUnavailable(
            f"no backend plugin answered for accelerator {accelerator!r}; the built-in accelerators are "
            f"{', '.join(BUILTIN_ACCELERATORS)}; other plugins loaded: {', '.join(others) or 'none'} "
            "(a third-party backend answers deepserve_select_backend for its own accelerator name)"
        )
    if not isinstance(backend, Backend):
        raise PluginError(
            f"deepserve_select_backend answered {accelerator!r} with a {type(backend).__name__}, "
            "not a deepserve.core.interfaces.Backend"
        )
    return backend


def list_plugins(pm: pluggy.PluginManager) -> list[PluginInfo]:
    """Every plugin registered with `pm`, in registration order, for `deepserve plugins`."""
    dists = {id(plugin): dist for plugin, dist in pm.list_plugin_distinfo()}
    infos = []
    for name, plugin in pm.list_name_plugin():
        if plugin is None:  # a blocked name
            continue
        dist = dists.get(id(plugin))
        if name in DEFAULT_PLUGINS:
            source = "built-in"
        else:
            source = "passed in" if dist is None else "entry point"
        module = getattr(plugin, "__name__", None) or f"{type(plugin).__module__}.{type(plugin).__qualname__}"
        infos.append(
            PluginInfo(
                name=name,
                module=module,
                source=source,
                dist=None if dist is None else dist.project_name,
                version=None if dist is None else dist.version,
                hooks=tuple(sorted(caller.name for caller in pm.get_hookcallers(plugin) or ())),
            )
        )
    return infos
