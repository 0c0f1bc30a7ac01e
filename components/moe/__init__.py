from components.moe.expert_parallel import apply_expert_parallel, check_expert_parallel

__all__ = ["apply_expert_parallel", "check_expert_parallel"]
