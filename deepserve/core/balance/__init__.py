"""Load balancers as pure algorithms (DESIGN.md §4.2): the expert-parallel load balancer (EPLB) today.

`eplb.rebalance_experts` is DeepSeek's placement algorithm; `placement.Placement` the value object the EP MoE
layer reads (and the imbalance metric); `expert_balancer.ExpertLoadBalancer` the windows and schedule that turn
per-step expert counts into reassignments (docs/eplb.md).
"""

from .eplb import rebalance_experts
from .expert_balancer import EplbConfig, ExpertLoadBalancer, RebalanceReport
from .placement import Placement

__all__ = ["EplbConfig", "ExpertLoadBalancer", "Placement", "RebalanceReport", "rebalance_experts"]
