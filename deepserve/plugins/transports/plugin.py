"""Registers the built-in expert-parallel transport (`all_to_all`)."""

from __future__ import annotations

from deepserve.core.hookspecs import Register, hookimpl


def _all_to_all(group, placement, experts):
    from deepserve.plugins.transports.all_to_all import AllToAllTransport

    return AllToAllTransport(group, placement, experts)


@hookimpl
def deepserve_register_expert_transports(register: Register) -> None:
    register("all_to_all", _all_to_all)
