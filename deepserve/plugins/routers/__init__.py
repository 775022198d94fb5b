"""The front's routing policies (docs/distributed.md), registered through `deepserve_register_dp_routers`."""
