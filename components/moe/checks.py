"""Expert parallelism's check on the meta model, before anything is built for real."""

from torch import nn

from components.moe.expert_parallel import check_expert_parallel, expert_modules
from components.moe.structure import experts_count
from components.problems import Problem, problems


def expert_parallel_problems(meta: nn.Module, experts: tuple[str, ...], ep: int, tp: int) -> list:
    """Why the experts ``experts`` names cannot be split over ``ep`` (beside ``tp``): none at
    ep=1."""
    if ep == 1:
        return []
    modules = expert_modules(meta, list(experts))
    num_experts = experts_count(meta.get_submodule(modules[0])) if modules else 0
    found: list[Problem] = problems(
        "ep", check_expert_parallel(meta, list(experts), num_experts, ep, tp)
    )
    return found
