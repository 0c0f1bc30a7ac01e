from components.moe.expert_parallel import (
    apply_expert_parallel,
    check_expert_parallel,
    dispatch_mode,
    expert_modules,
)
from components.moe.load_balance import (
    ExpertLoad,
    RoutingBias,
    load_balancing_loss,
    load_metrics,
    router_aux_loss_weight,
    uncounted_experts,
)

__all__ = [
    "ExpertLoad",
    "RoutingBias",
    "apply_expert_parallel",
    "check_expert_parallel",
    "dispatch_mode",
    "expert_modules",
    "load_balancing_loss",
    "load_metrics",
    "router_aux_loss_weight",
    "uncounted_experts",
]
