"""The device mesh: ``("dp", "tp")`` with tp innermost (``("dp", "cp", "tp")`` with context
parallelism; ``("dp_replicate", "dp_shard", "tp")`` with HSDP, ``dp`` its flattened pair; ``pp``
outermost with pipeline parallelism), and the MoE view ``("ep_shard", "ep")``.

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
    dp_replicate: int = 1  # HSDP: dp = dp_replicate × dp_shard; FSDP shards within dp_shard
    pp: int = 1  # pipeline stages' ranks, outermost: world = pp × dp × cp × tp

    @property
    def dp_shard(self) -> int:
        """The ranks FSDP shards the weights over inside one replica group."""
        return self.dp // self.dp_replicate

    @property
    def data_parallel(self) -> int:
        """Ranks the weights are data parallel over (FSDP's): ``dp × cp``."""
        return self.dp * self.cp

    @property
    def ep_shard(self) -> int:
        return self.world_size // self.ep


def resolve_parallel_dims(
    world_size: int,
    tp: int = 1,
    dp: int | None = None,
    ep: int = 1,
    cp: int = 1,
    dp_replicate: int = 1,
    dp_shard: int | None = None,
    pp: int = 1,
) -> ParallelDims:
    """Check the sizes and infer ``dp`` when it is None; every problem is reported at once.

    Raises:
        ValueError: naming each size that does not fit, e.g. "world size 6 is not divisible by
            tp=4".
    """
    errors = []
    sizes = (("world size", world_size), ("tp", tp), ("dp", dp), ("ep", ep), ("cp", cp))
    sizes += (("dp_replicate", dp_replicate), ("dp_shard", dp_shard), ("pp", pp))
    for name, value in sizes:
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 1
        ):
            errors.append(f"{name} must be a positive integer, got {value!r}")
    if errors:
        raise ValueError("; ".join(errors))
    dp, errors = _hybrid_dp(dp, dp_replicate, dp_shard, cp)
    inner, named = cp * tp, f"tp={tp}" if cp == 1 else f"cp={cp} × tp={tp}"
    if pp > 1:
        inner, named = pp * inner, f"pp={pp} × {named}"
    if world_size % inner:
        errors.append(f"world size {world_size} is not divisible by {named}")
    elif dp is None:
        dp = world_size // inner
    elif dp * inner != world_size:
        product = f"dp={dp} × {named} = {dp * inner}"
        errors.append(f"{product} does not match the world size {world_size}")
    if dp is not None and dp % dp_replicate:
        errors.append(f"dp={dp} is not divisible by dp_replicate={dp_replicate}")
    if world_size % ep:
        errors.append(f"world size {world_size} is not divisible by ep={ep}")
    if errors:
        raise ValueError("; ".join(errors))
    return ParallelDims(
        world_size=world_size, dp=dp, tp=tp, ep=ep, cp=cp, dp_replicate=dp_replicate, pp=pp
    )


def _hybrid_dp(
    dp: int | None, dp_replicate: int, dp_shard: int | None, cp: int
) -> tuple[int | None, list[str]]:
    """``dp`` from the HSDP pair: ``dp_replicate × dp_shard`` when ``dp_shard`` is given (and ``dp``
    agrees with it), else ``dp`` as given (None: inferred from the world, then split)."""
    errors = []
    if dp_replicate > 1 and cp > 1:
        errors.append(f"dp_replicate={dp_replicate} with cp={cp} is not supported: HSDP needs cp=1")
    if dp_shard is not None:
        product = dp_replicate * dp_shard
        if dp is not None and dp != product:
            errors.append(
                f"dp={dp} does not match dp_replicate={dp_replicate} × dp_shard={dp_shard} = "
                f"{product}: give dp or the pair, not both"
            )
        dp = product if dp is None else dp
    return dp, errors


def mesh_layout(dims: ParallelDims) -> tuple[tuple[str, int], ...]:
    """The mesh's dimensions as data, outermost first: ``pp`` (when > 1), then ``dp`` (with HSDP
    ``dp_replicate``, ``dp_shard``), ``cp`` (when > 1), ``tp`` innermost (TP groups are adjacent
    ranks)."""
    pipeline = (("pp", dims.pp),) if dims.pp > 1 else ()
    if dims.dp_replicate > 1:
        data = (("dp_replicate", dims.dp_replicate), ("dp_shard", dims.dp_shard))
    else:
        data = (("dp", dims.dp),)
    context = (("cp", dims.cp),) if dims.cp > 1 else ()
    return (*pipeline, *data, *context, ("tp", dims.tp))


def build_device_mesh(
    dims: ParallelDims, device_type: str, timeout: timedelta | None = None
) -> DeviceMesh:
    """The mesh over all ranks, its dimensions :func:`mesh_layout`'s (``("dp", "tp")``;
    ``("pp", "dp_replicate", "dp_shard", "cp", "tp")`` at most), and the flattened views made here,
    at the same moment on every rank, as their process groups must be: :func:`dp_mesh` with HSDP,
    :func:`data_parallel_mesh` with cp. Its groups time out after ``timeout`` (the run's
    ``collective_timeout_minutes``)."""
    layout = mesh_layout(dims)
    shape, names = tuple(size for _, size in layout), tuple(name for name, _ in layout)
    mesh = _with_timeout(init_device_mesh(device_type, shape, mesh_dim_names=names), timeout)
    if dims.dp_replicate > 1:
        _with_timeout(dp_mesh(mesh), timeout)
    if dims.cp > 1:
        _with_timeout(data_parallel_mesh(mesh), timeout)
    return mesh


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The ``dp`` ranks: ``mesh["dp"]``, or with HSDP the flattened ``dp_replicate × dp_shard``
    (rank ``r * dp_shard + s``; made once, then torch's cached one)."""
    if "dp_replicate" in (mesh.mesh_dim_names or ()):
        return mesh["dp_replicate", "dp_shard"]._flatten("dp")
    return mesh["dp"]


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The ranks the weights are data parallel over: ``mesh["dp"]``, or with a ``cp`` dimension the
    flattened ``dp × cp`` (``dp_cp``; made once, then torch's cached one). FSDP shards over it, and
    every sum over the batch (the loss, the validation loss) reduces over it."""
    if "cp" not in (mesh.mesh_dim_names or ()):
        return dp_mesh(mesh)
    return mesh["dp", "cp"]._flatten("dp_cp")


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 shards over: with HSDP the 2-D ``("dp_replicate", "dp_shard")`` (replicate
    across dim 0, shard within dim 1), else :func:`data_parallel_mesh`."""
    if "dp_replicate" in (mesh.mesh_dim_names or ()):
        return mesh["dp_replicate", "dp_shard"]
    return data_parallel_mesh(mesh)


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
