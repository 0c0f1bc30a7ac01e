"""Expert parallelism's checks on the meta model, before anything is built for real: what the
experts cannot take at ``ep``, and the fact the layout's rules read of them
(``components/distributed/layout.py``)."""

from torch import nn

from components.moe.expert_parallel import check_expert_parallel, expert_modules, routed_experts
from components.moe.structure import experts_count
from components.problems import Problem, problems


def expert_parallel_problems(meta: nn.Module, experts: tuple[str, ...], ep: int) -> list[Problem]:
    """Why the experts ``experts`` names cannot be split over ``ep``: none at ep=1."""
    if ep == 1:
        return []
    modules = expert_modules(meta, list(experts))
    num_experts = experts_count(meta.get_submodule(modules[0])) if modules else 0
    return problems("ep", check_expert_parallel(meta, list(experts), num_experts, ep))


def routed_experts_of(meta: nn.Module | None, experts: tuple[str, ...]) -> str | None:
    """``ModelFacts.routed_experts`` of the meta model (None when none was built: at tp=1 and
    ep=1, where the rule that reads it does not apply)."""
    return routed_experts(meta, list(experts)) if meta is not None and experts else None
