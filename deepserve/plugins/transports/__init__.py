"""Expert-parallel transports (docs/distributed.md), registered through `deepserve_register_expert_transports`."""
