"""``train.cpu_offload`` in the memory model (``memory_model.py``): on CUDA FSDP2's
``CPUOffloadPolicy`` keeps each sharded parameter, its gradient and so the optimizer's state and
step in host memory (pinned); the device keeps what is gathered for compute: FSDP's unsharded
layers in flight, the root's gathered parameters, a layer's unsharded gradients before their
reduce-scatter (every micro-batch's reduced at once: the recipe's ``reduce_each_micro_batch``, so
accumulated gradients are the host's shards), each layer's shard staged from the host
for its all-gather and its reduce-scatter's output before the copy back, the activations and the
runtime. On the CPU host and device are one memory: nothing moves (FSDP then wraps the model at
dp=1 too, priced as FSDP over one rank). Docs: docs/precision-and-memory.md
"""


def offloaded(cpu_offload: bool, device_type: str) -> bool:
    """Whether ``train.cpu_offload`` moves anything off the device: on CUDA only."""
    return cpu_offload and device_type == "cuda"


def host_bytes(state: dict, optimizer: float, replica_sync: float) -> dict[str, float]:
    """Bytes a rank holds in host memory under offload, from the memory model's ``_state``: its
    sharded parameters as stored, their gradients, the ``optimizer`` state, the step's
    temporaries on the host CPU (two of the largest shard, torch's CPU loop) and the replica
    sync's flat buffer (``replica_sync``: the gradients it reads are the host's)."""
    return {
        "params": state["bytes"],
        "grads": state["grad_bytes"],
        "optimizer": optimizer,
        "optimizer_step": 2 * state["largest_bytes"],
        "replica_sync": replica_sync,
    }


def staging_bytes(state: dict, sharding: int, backward: bool = True) -> float:
    """Device bytes of the shards of FSDP's two layers in flight: each copied from the host for
    its all-gather (in its stored dtype, NF4 tiles as stored) and, in a ``backward``, its
    reduce-scatter's fp32 output, kept until the copy to the host."""
    shard = state["layer_numel"] / sharding
    return 2 * (shard * (state["element"] + 4 * backward) + state["nf4_layer_bytes"] / sharding)


RANKS_PER_NODE = 8  # a node of 8 GPUs: the host memory a dry run adds up per node


def host_row(per_rank_gib: float, world_size: int) -> dict:
    """plan.json's ``host_gib``: the (pinned) host memory per rank and per node (its ranks, at
    most :data:`RANKS_PER_NODE`, × per rank)."""
    ranks = min(world_size, RANKS_PER_NODE)
    return {"per_rank": per_rank_gib, "ranks_per_node": ranks, "per_node": per_rank_gib * ranks}


def host_words(host: dict) -> str:
    """:func:`host_row` in words."""
    return (
        f"{host['per_rank']:.2f} GiB of pinned host memory per rank, {host['per_node']:.2f} per "
        f"node of {host['ranks_per_node']} ranks"
    )
