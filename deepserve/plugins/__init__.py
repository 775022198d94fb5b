"""Built-in plugins that are not accelerator backends: structured output (`structured/`), later speculative
decoding and cache stores. Each is a plugin module listed in `deepserve.core.plugins.DEFAULT_PLUGINS`."""
