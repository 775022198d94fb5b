"""Built-in plugins that are not accelerator backends: structured output (`structured/`), speculative decoding
(`speculative/`) and block stores (`cache/`). Each is a plugin module listed in `deepserve.core.plugins.DEFAULT_PLUGINS`."""
