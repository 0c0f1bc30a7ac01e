"""Interim `make run`: show tp_replicas keeping a real Hugging Face model's copies identical on 2 ranks.

It does not train. Each rank builds a tiny LlamaForCausalLM with a *different* seed (as ranks that load
or initialise differently would), then `broadcast_tp_replicas` makes the copies identical; each rank runs
backward on different tokens, then `synchronize_tp_replica_gradients` averages the gradients so the next
optimizer step would be the same everywhere. The fine-tuning recipe (recipes/finetune.py) replaces this.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from components.distributed.launch import init_process_group, launch_local  # noqa: E402
from components.distributed.tp_replicas import (  # noqa: E402
    broadcast_tp_replicas,
    synchronize_tp_replica_gradients,
)


def max_spread(tensors: list[torch.Tensor]) -> float:
    """Largest difference between this rank's tensors and rank 0's, taken over the whole model."""
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    spread = (flat - reference).abs().max()
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    return spread.item()


def demo() -> None:
    init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    torch.manual_seed(rank)  # deliberately different start on each rank
    config = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    say = print if rank == 0 else (lambda *_: None)
    say(f"weights differ across ranks by up to {max_spread(list(model.parameters())):.4f}")
    count = broadcast_tp_replicas([model], mesh)
    say(f"broadcast_tp_replicas: {count} tensors; weights now differ by {max_spread(list(model.parameters()))}")

    tokens = torch.randint(0, config.vocab_size, (2, 16))  # different tokens on each rank
    model(input_ids=tokens, labels=tokens).loss.backward()
    grads = [p.grad for p in model.parameters()]
    say(f"gradients differ across ranks by up to {max_spread(grads):.4f}")
    count = synchronize_tp_replica_gradients([model], mesh)
    say(f"synchronize_tp_replica_gradients: {count} gradients; now differ by {max_spread(grads)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    launch_local(demo, 2)
