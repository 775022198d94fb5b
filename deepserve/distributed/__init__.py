"""Scale-out (docs/distributed.md): data-parallel attention over rank processes behind a front, and
expert-parallel MoE through a transport seam.

`placement.py` (logical -> physical experts), `transport.py` (the `ExpertTransport` seam), `expert_parallel.py`
(a rank's experts: loading and wiring the MoE layers), `rank.py` (the rank loop and the lockstep runner),
`front.py` (the engine the front drives), `router.py` (the routing-policy seam), `messages.py` (the ZMQ wire),
`launch.py` (ports, backends, processes). Built-in plugins: `deepserve/plugins/transports/` (`all_to_all`) and
`deepserve/plugins/routers/` (`least_loaded`).
"""
