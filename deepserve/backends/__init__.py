"""Accelerator backends: each implements `deepserve.core.interfaces.Backend` and registers itself as a plugin."""
