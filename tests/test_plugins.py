"""The plugin manager, each hook through it, backend selection, and a third-party plugin loaded through a
real entry point. Every test builds its own manager, so no plugin outlives its test."""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
import textwrap
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pluggy
import pytest
import torch

from deepserve.core.config import EngineConfig
from deepserve.core.env import ENV_VARS, env_value
from deepserve.core.hookspecs import hookimpl
from deepserve.core.interfaces import Backend, BackendUnavailable
from deepserve.core.plugins import (
    DEFAULT_PLUGINS,
    REGISTER_HOOKS,
    PluginError,
    collect_registrations,
    list_plugins,
    make_plugin_manager,
    resolve_accelerator,
    select_backend,
)

REGISTER_HOOK_NAMES = [
    "deepserve_register_cache_backends",
    "deepserve_register_dp_routers",
    "deepserve_register_expert_transports",
    "deepserve_register_grammar_backends",
    "deepserve_register_proposers",
    "deepserve_register_routes",
]


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ENV_VARS.values():
        monkeypatch.delenv(var.name, raising=False)
        if var.alias:
            monkeypatch.delenv(var.alias, raising=False)


# -- builders ---------------------------------------------------------------------------------------------------
def _unused_op(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("selection tests never run ops")


def make_backend(name: str) -> Backend:
    """A `Backend` with only a name and a device."""
    ops = dict.fromkeys(Backend.__abstractmethods__, _unused_op)
    return type(f"{name.title()}Backend", (Backend,), {**ops, "name": name, "device": "cpu"})()


def make_plugin(name: str, **hooks: Callable[..., Any]) -> types.ModuleType:
    """A plugin module called `name` implementing `hooks` (hook name -> function)."""
    module = types.ModuleType(name)
    for hook_name, function in hooks.items():
        setattr(module, hook_name, hookimpl(function))
    return module


def backend_plugin(name: str, accelerator: str, backend: Any = None) -> types.ModuleType:
    """A plugin answering `deepserve_select_backend` for `accelerator`."""
    answer = make_backend(name) if backend is None else backend

    def select(config: EngineConfig) -> Any:
        return answer if config.accelerator == accelerator else None

    return make_plugin(name, deepserve_select_backend=select)


def registering_plugin(name: str, hook_name: str, things: dict[str, Any]) -> types.ModuleType:
    """A plugin whose `hook_name` registers each (name, factory) of `things`."""

    def register_all(register: Callable[[str, Any], None]) -> None:
        for thing, factory in things.items():
            register(thing, factory)

    return make_plugin(name, **{hook_name: register_all})


# -- the manager ------------------------------------------------------------------------------------------------
def test_builtin_plugins_register_first_under_their_module_names():
    infos = list_plugins(make_plugin_manager(load_entrypoints=False))
    assert [info.name for info in infos] == DEFAULT_PLUGINS
    assert all(info.source == "built-in" for info in infos)
    hooks = {info.name: info.hooks for info in infos}
    assert all(hooks[name] == ("deepserve_select_backend",) for name in hooks if name.startswith("deepserve.backends."))
    assert hooks["deepserve.plugins.structured.plugin"] == ("deepserve_register_grammar_backends",)


def test_a_misspelt_hook_is_an_error_at_startup():
    typo = make_plugin("typo", deepserve_select_backends=lambda config: None)
    with pytest.raises(pluggy.PluginValidationError, match="deepserve_select_backends"):
        make_plugin_manager(load_entrypoints=False, plugins=[typo])


def test_passed_in_plugins_are_listed_with_their_hooks():
    pm = make_plugin_manager(load_entrypoints=False, plugins=[backend_plugin("fakeaccel", "fake")])
    info = list_plugins(pm)[-1]
    assert (info.name, info.source, info.dist) == ("fakeaccel", "passed in", None)
    assert info.hooks == ("deepserve_select_backend",)


def test_register_hooks_are_the_ones_the_manager_knows():
    assert sorted(REGISTER_HOOKS) == REGISTER_HOOK_NAMES


# -- register hooks ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hook_name", REGISTER_HOOK_NAMES)
def test_register_hook_collects_every_plugins_factories(hook_name: str):
    one = registering_plugin("one", hook_name, {"a": dict, "b": list})
    two = registering_plugin("two", hook_name, {"c": set})
    pm = make_plugin_manager(load_entrypoints=False, plugins=[one, two])
    builtins = {name: collect_registrations(make_plugin_manager(load_entrypoints=False), name)
                for name in REGISTER_HOOK_NAMES}  # e.g. the llguidance grammar backend
    found = collect_registrations(pm, hook_name)
    assert found == {**builtins[hook_name], "a": dict, "b": list, "c": set}
    others = [name for name in REGISTER_HOOK_NAMES if name != hook_name]
    assert all(collect_registrations(pm, other) == builtins[other] for other in others)


@pytest.mark.parametrize("hook_name", REGISTER_HOOK_NAMES)
def test_register_hook_refuses_a_name_registered_twice_naming_both_plugins(hook_name: str):
    first = registering_plugin("first", hook_name, {"x": dict})
    second = registering_plugin("second", hook_name, {"x": list})
    pm = make_plugin_manager(load_entrypoints=False, plugins=[first, second])
    with pytest.raises(PluginError, match="'x' is registered twice") as error:
        collect_registrations(pm, hook_name)
    assert "'first'" in str(error.value) and "'second'" in str(error.value)


@pytest.mark.parametrize("hook_name", REGISTER_HOOK_NAMES)
@pytest.mark.parametrize(
    "things, message",
    [({"x": 42}, "'x' as a int, which is not callable"), ({"": dict}, "registered the name ''")],
)
def test_register_hook_refuses_bad_registrations_naming_the_plugin(hook_name: str, things: dict, message: str):
    pm = make_plugin_manager(load_entrypoints=False, plugins=[registering_plugin("sloppy", hook_name, things)])
    with pytest.raises(PluginError, match=message) as error:
        collect_registrations(pm, hook_name)
    assert "plugin 'sloppy'" in str(error.value)


def test_collect_registrations_refuses_a_hook_that_is_not_a_register_hook():
    with pytest.raises(PluginError, match="not a register hook"):
        collect_registrations(make_plugin_manager(load_entrypoints=False), "deepserve_select_backend")


# -- deepserve_request_finished --------------------------------------------------------------------------------
def test_request_finished_calls_every_observer_once():
    seen: dict[str, list] = {"billing": [], "logging": []}

    def observer(name: str) -> types.ModuleType:
        def record(request: Any, stats: Any) -> None:
            seen[name].append((request, stats))

        return make_plugin(name, deepserve_request_finished=record)

    pm = make_plugin_manager(load_entrypoints=False, plugins=[observer("billing"), observer("logging")])
    request, stats = object(), {"num_output_tokens": 7}
    pm.hook.deepserve_request_finished(request=request, stats=stats)
    assert seen == {"billing": [(request, stats)], "logging": [(request, stats)]}


# -- deepserve_select_backend -----------------------------------------------------------------------------------
def test_forcing_cpu_selects_the_reference_backend():
    backend = select_backend(make_plugin_manager(load_entrypoints=False), EngineConfig(accelerator="cpu"))
    assert (type(backend).__name__, backend.name, backend.device) == ("ReferenceBackend", "cpu", "cpu")


@pytest.mark.skipif(torch.cuda.is_available() or importlib.util.find_spec("torch_npu") is not None, reason="CPU only")
def test_auto_on_a_cpu_machine_selects_the_reference_backend():
    assert select_backend(make_plugin_manager(load_entrypoints=False), EngineConfig()).name == "cpu"


def test_a_plugin_answering_auto_wins_over_the_reference_backend():
    pm = make_plugin_manager(load_entrypoints=False, plugins=[backend_plugin("mychip", "auto")])
    assert select_backend(pm, EngineConfig()).name == "mychip"


def test_select_backend_first_answer_wins_newest_plugin_first():
    older, newer = backend_plugin("older", "fake"), backend_plugin("newer", "fake")
    passes = make_plugin("passes", deepserve_select_backend=lambda config: None)
    pm = make_plugin_manager(load_entrypoints=False, plugins=[older, newer, passes])
    assert select_backend(pm, EngineConfig(accelerator="fake")).name == "newer"


def test_select_backend_tryfirst_beats_registration_order():
    first = make_plugin("first")
    first.deepserve_select_backend = hookimpl(tryfirst=True)(lambda config: make_backend("first"))
    pm = make_plugin_manager(load_entrypoints=False, plugins=[first, backend_plugin("newer", "fake")])
    assert select_backend(pm, EngineConfig(accelerator="fake")).name == "first"


@pytest.mark.parametrize("variable", ["DEEPSERVE_ACCELERATOR", "DEEPINFER_ACCELERATOR"])
def test_the_environment_forces_the_accelerator_on_auto(monkeypatch: pytest.MonkeyPatch, variable: str):
    monkeypatch.setenv(variable, " Fake ")
    pm = make_plugin_manager(load_entrypoints=False, plugins=[backend_plugin("fakeaccel", "fake")])
    config = EngineConfig()
    assert select_backend(pm, config).name == "fakeaccel"
    assert config.accelerator == "auto"  # the caller's config is not changed


def test_deepserve_variable_wins_over_its_deepinfer_alias(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("DEEPSERVE_ACCELERATOR", "fake")
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "cpu")
    assert resolve_accelerator(EngineConfig()) == "fake"


def test_explicit_config_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("DEEPSERVE_ACCELERATOR", "cpu")
    pm = make_plugin_manager(load_entrypoints=False, plugins=[backend_plugin("fakeaccel", "fake")])
    assert select_backend(pm, EngineConfig(accelerator="fake")).name == "fakeaccel"


def test_an_unknown_accelerator_is_a_clear_error():
    with pytest.raises(BackendUnavailable, match=r"accelerator 'tpu'.*auto, cpu, nvidia, ascend"):
        select_backend(make_plugin_manager(load_entrypoints=False), EngineConfig(accelerator="tpu"))


def test_an_answer_that_is_not_a_backend_is_a_plugin_error():
    pm = make_plugin_manager(load_entrypoints=False, plugins=[backend_plugin("liar", "fake", backend="a string")])
    with pytest.raises(PluginError, match="with a str, not a deepserve.core.interfaces.Backend"):
        select_backend(pm, EngineConfig(accelerator="fake"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_forcing_nvidia_without_cuda_says_cuda_is_missing():
    with pytest.raises(BackendUnavailable, match="needs a CUDA GPU"):
        select_backend(make_plugin_manager(load_entrypoints=False), EngineConfig(accelerator="nvidia"))


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed")
def test_forcing_ascend_without_torch_npu_says_torch_npu_is_missing():
    with pytest.raises(BackendUnavailable, match="torch_npu is not installed"):
        select_backend(make_plugin_manager(load_entrypoints=False), EngineConfig(accelerator="ascend"))


def test_core_and_accelerator_plugins_import_without_torch():
    modules = ["deepserve.core.plugins", "deepserve.backends.nvidia.plugin", "deepserve.backends.ascend.plugin"]
    code = f"import sys; [__import__(m) for m in {modules!r}]; print(sorted({{'torch', 'aiohttp'}} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


# -- env --------------------------------------------------------------------------------------------------------
def test_env_value_prefers_the_deepserve_name_and_falls_back_to_the_alias():
    assert env_value("DEEPSERVE_MODEL", {"DEEPINFER_HF_MODEL_DIR": "/a", "DEEPSERVE_MODEL": "/b"}) == "/b"
    assert env_value("DEEPSERVE_MODEL", {"DEEPINFER_HF_MODEL_DIR": "/a"}) == "/a"
    assert env_value("DEEPSERVE_MODEL", {}) is None
    assert env_value("DEEPSERVE_PLUGINS", {"DEEPSERVE_PLUGINS": ""}) == ""  # set to empty still counts as set


def test_env_value_refuses_an_unknown_variable():
    with pytest.raises(KeyError, match="DEEPSERVE_MODLE"):
        env_value("DEEPSERVE_MODLE")


# -- a third-party plugin through a real entry point ------------------------------------------------------------
@pytest.fixture
def install_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str, str, str], str]]:
    """Install a distribution with one `deepserve` entry point the way pip lays it out (a `.dist-info` folder
    beside the module), on a temporary sys.path entry; returns the module name."""
    installed: list[str] = []
    monkeypatch.syspath_prepend(str(tmp_path))

    def install(dist: str, entry_point: str, source: str) -> str:
        module = dist.replace("-", "_")
        info = tmp_path / f"{module}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text(f"[deepserve]\n{entry_point} = {module}\n")
        (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
        importlib.invalidate_caches()
        installed.append(module)
        return module

    yield install
    for module in installed:
        sys.modules.pop(module, None)


DRAFTER_PLUGIN = """
    from deepserve.core.hookspecs import hookimpl

    @hookimpl
    def deepserve_register_proposers(register):
        register("tiny-drafter", dict)
"""


def third_party_proposers(pm) -> dict:
    """The proposers registered besides the built-in ones (`mtp`, `dspark`)."""
    return {name: f for name, f in collect_registrations(pm, "deepserve_register_proposers").items()
            if name not in ("mtp", "dspark")}


def test_an_installed_plugin_loads_through_its_entry_point(install_plugin):
    install_plugin("deepserve-tiny-drafter", "tiny", DRAFTER_PLUGIN)
    pm = make_plugin_manager()
    assert third_party_proposers(pm) == {"tiny-drafter": dict}
    info = next(info for info in list_plugins(pm) if info.name == "tiny")
    assert (info.module, info.source) == ("deepserve_tiny_drafter", "entry point")
    assert (info.dist, info.version, info.hooks) == ("deepserve-tiny-drafter", "1.0", ("deepserve_register_proposers",))


@pytest.mark.parametrize("allowlist", ["deepserve-tiny-drafter", "Deepserve_Tiny.Drafter", "tiny", "other, tiny"])
def test_the_allowlist_admits_a_plugin_by_distribution_or_entry_point_name(install_plugin, monkeypatch, allowlist):
    install_plugin("deepserve-tiny-drafter", "tiny", DRAFTER_PLUGIN)
    monkeypatch.setenv("DEEPSERVE_PLUGINS", allowlist)
    assert "tiny-drafter" in collect_registrations(make_plugin_manager(), "deepserve_register_proposers")


@pytest.mark.parametrize("allowlist", ["", "someone-else"])
def test_a_plugin_outside_the_allowlist_is_not_even_imported(install_plugin, monkeypatch, allowlist):
    module = install_plugin("deepserve-tiny-drafter", "tiny", DRAFTER_PLUGIN)
    monkeypatch.setenv("DEEPSERVE_PLUGINS", allowlist)
    pm = make_plugin_manager()
    assert third_party_proposers(pm) == {}
    assert module not in sys.modules and not pm.is_blocked("tiny")
    assert [info.name for info in list_plugins(pm)] == DEFAULT_PLUGINS  # built-ins always load


def test_a_broken_plugin_is_a_clear_error_and_the_allowlist_routes_around_it(install_plugin, monkeypatch):
    install_plugin("deepserve-broken", "broken", "import a_module_that_is_not_there\n")
    with pytest.raises(PluginError, match="a_module_that_is_not_there.*DEEPSERVE_PLUGINS"):
        make_plugin_manager()
    monkeypatch.setenv("DEEPSERVE_PLUGINS", "")
    assert [info.name for info in list_plugins(make_plugin_manager())] == DEFAULT_PLUGINS
