"""Registers the built-in routing policy of the data-parallel front (`least_loaded`)."""

from __future__ import annotations

from deepserve.core.hookspecs import Register, hookimpl


def _least_loaded(world_size: int):
    from deepserve.plugins.routers.least_loaded import LeastLoaded

    return LeastLoaded()


@hookimpl
def deepserve_register_dp_routers(register: Register) -> None:
    register("least_loaded", _least_loaded)
