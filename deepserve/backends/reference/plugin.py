"""Built-in plugin: the pure-PyTorch reference backend, for `cpu` and as the last resort on `auto`."""

from __future__ import annotations

from deepserve.core.config import EngineConfig
from deepserve.core.hookspecs import hookimpl
from deepserve.core.interfaces import Backend


@hookimpl(trylast=True)
def deepserve_select_backend(config: EngineConfig) -> Backend | None:
    # trylast: on `auto` every accelerator plugin gets its chance first; the reference ops run anywhere.
    if config.accelerator not in ("cpu", "auto"):
        return None
    from deepserve.backends.reference import ReferenceBackend

    # exact ops unless the config asks for speed (batch_invariant=False)
    return ReferenceBackend(device=config.device or "cpu", exact=config.batch_invariant is not False)
