"""The device mesh: ``("dp", "tp")`` with tp innermost (``("dp", "cp", "tp")`` with context
parallelism), and the MoE view ``("ep_shard", "ep")``.

Tensor parallelism talks the most, so its ranks are adjacent (innermost: on one node, on NVLink),
then the cp ranks that split one sequence. The data-parallel view is :func:`data_parallel_mesh`:
``mesh["dp"]``, or with cp > 1 the flattened ``dp × cp`` (FSDP shards and reduces over it, the cp
ranks being data parallel for the weights). Expert parallelism uses the same ranks: the MoE mesh
reshapes all ``dp × tp`` ranks into ``(world // ep, ep)``, so a rank's expert group is ``ep``
adjacent ranks (inside one TP group when ``ep`` divides ``tp``, else spanning several dp ranks) and
``ep_shard`` runs across the groups that hold the same experts.
"""

from dataclasses import dataclass
from datetime import timedelta

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.distributed_c10d import _set_pg_timeout


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """How ``world_size`` ranks are split: ``dp × cp × tp == world_size``; ``ep`` divides
    ``world_size``."""

    world_size: int
    dp: int
    tp: int
    ep: int = 1
    cp: int = 1

    @property
    def data_parallel(self) -> int:
        """Ranks the weights are data parallel over (FSDP's): ``dp × cp``."""
        return self.dp * self.cp

    @property
    def ep_shard(self) -> int:
        return self.world_size // self.ep


def resolve_parallel_dims(
    world_size: int, tp: int = 1, dp: int | None = None, ep: int = 1, cp: int = 1
) -> ParallelDims:
    """Check the sizes and infer ``dp`` when it is None; every problem is reported at once.

    Raises:
        ValueError: naming each size that does not fit, e.g. "world size 6 is not divisible by
            tp=4".
    """
    errors = []
    sizes = (("world size", world_size), ("tp", tp), ("dp", dp), ("ep", ep), ("cp", cp))
    for name, value in sizes:
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 1
        ):
            errors.append(f"{name} must be a positive integer, got {value!r}")
    if errors:
        raise ValueError("; ".join(errors))
    inner, named = cp * tp, f"tp={tp}" if cp == 1 else f"cp={cp} × tp={tp}"
    if world_size % inner:
        errors.append(f"world size {world_size} is not divisible by {named}")
    elif dp is None:
        dp = world_size // inner
    elif dp * inner != world_size:
        product = f"dp={dp} × {named} = {dp * inner}"
        errors.append(f"{product} does not match the world size {world_size}")
    if world_size % ep:
        errors.append(f"world size {world_size} is not divisible by ep={ep}")
    if errors:
        raise ValueError("; ".join(errors))
    return ParallelDims(world_size=world_size, dp=dp, tp=tp, ep=ep, cp=cp)


def build_device_mesh(
    dims: ParallelDims, device_type: str, timeout: timedelta | None = None
) -> DeviceMesh:
    """The ``("dp", "tp")`` mesh over all ranks, tp innermost (TP groups are adjacent ranks), or
    with ``dims.cp > 1`` ``("dp", "cp", "tp")`` and its flattened ``dp_cp`` (made here, at the same
    moment on every rank, as its process group must be); its groups time out after ``timeout``
    (the run's ``collective_timeout_minutes``)."""
    if dims.cp == 1:
        shape, names = (dims.dp, dims.tp), ("dp", "tp")
        return _with_timeout(init_device_mesh(device_type, shape, mesh_dim_names=names), timeout)
    shape, names = (dims.dp, dims.cp, dims.tp), ("dp", "cp", "tp")
    mesh = _with_timeout(init_device_mesh(device_type, shape, mesh_dim_names=names), timeout)
    _with_timeout(data_parallel_mesh(mesh), timeout)
    return mesh


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The ranks the weights are data parallel over: ``mesh["dp"]``, or with a ``cp`` dimension the
    flattened ``dp × cp`` (``dp_cp``; made once, then torch's cached one). FSDP shards over it, and
    every sum over the batch (the loss, the validation loss) reduces over it."""
    if "cp" not in (mesh.mesh_dim_names or ()):
        return mesh["dp"]
    return mesh["dp", "cp"]._flatten("dp_cp")


def build_moe_mesh(
    device_mesh: DeviceMesh, dims: ParallelDims, timeout: timedelta | None = None
) -> DeviceMesh:
    """The ``("ep_shard", "ep")`` view of the same ranks, derived from ``device_mesh``'s root so the
    meshes share one world: ``ep`` adjacent ranks split the experts. Build it only when ``ep >
    1``."""
    world = device_mesh._flatten("world")
    return _with_timeout(world._unflatten(0, (dims.ep_shard, dims.ep), ("ep_shard", "ep")), timeout)


def _with_timeout(mesh: DeviceMesh, timeout: timedelta | None) -> DeviceMesh:
    """Give every group of ``mesh`` the run's timeout: torch makes a mesh's groups with the
    backend's default (30 minutes on gloo), not the timeout the world was joined with, so a stuck
    peer would hang a TP or dp collective for half an hour whatever the user set."""
    if timeout is not None:
        for dim in range(mesh.ndim):
            _set_pg_timeout(timeout, mesh.get_group(dim))
    return mesh
