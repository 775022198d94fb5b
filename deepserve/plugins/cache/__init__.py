"""Built-in block stores (`deepserve.core.kv.store.BlockStore`), contributed by URI scheme through
`deepserve_register_cache_backends` (`plugin.py`)."""
