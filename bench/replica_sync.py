"""Replica gradient sync: time and extra buffer memory of ``synchronize_tp_replica_gradients`` against baselines.

Why: the parameters TP does not shard (norms, q/k norms, routers) need one gradient reduction per optimizer
step. Ours flattens them into bounded buffers; the question is whether that is close to the best one can do
(one all-reduce of the same bytes already in one flat buffer, "floor") and how much faster it is than the
simple per-tensor all-reduce of Hugging Face style hooks, on realistic sets of replicated gradients.

Variants, run in one gloo process group per world size, in an order rotated every repetition:

- ``ours``: ``synchronize_tp_replica_gradients([model], mesh)`` on a ("tp",) mesh.
- ``per_tensor``: one ``all_reduce`` per gradient, in place, then ``div_`` for mean (HF hook style).
- ``flatten``: one unbounded ``torch.cat`` per (reduction, dtype), one all-reduce, copy back (Megatron style);
  low-precision gradients are reduced in their own dtype, as Megatron does without an fp32 main grad.
- ``floor``: one all-reduce of a preallocated flat fp32 buffer of the bytes ``ours`` puts on the wire.
- ``precheck`` (diagnostic, part of ``ours``): only the int32 [3, tensors] flag all-reduce ``ours`` runs first.

Time: every rank waits at a barrier, runs the variant, and records its own elapsed time; a repetition's time
is the slowest rank's. The median over the repetitions (after warm-up) is reported.

Extra memory: computed analytically from the buffers each variant allocates and their lifetimes as the code
is written (``ours`` from the source of ``tp_replicas.py``: one chunk's buffer at a time, allocated at its
wire dtype and filled slice by slice, so the peak is the largest chunk). A measured cross-check (rank 0's
peak resident set above its resident set before the call, Linux ``VmHWM`` reset through
``/proc/self/clear_refs``) is shown next to it; it undercounts whenever the allocator reuses pages that are
already resident.
"""

import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from components.distributed.launch import init_process_group, launch_local
from components.distributed.tp_replicas import (
    _MAX_FLAT_BUFFER_BYTES,
    _TP_REPLICA_GRAD_REDUCTION_ATTR,
    mark_tp_replica_gradient_reduction,
    synchronize_tp_replica_gradients,
)

MIB = 1024 * 1024
WARMUP = 1
REPS = 7
VARIANTS = ("ours", "per_tensor", "flatten", "floor", "precheck")
# Goals of issue 8.
FLOOR_RATIO_GOAL = 1.2
BUFFER_GOAL_BYTES = 256 * MIB
SPEEDUP_GOAL = 10.0
SPEEDUP_SCENARIOS = ("b", "d")


class Holder(nn.Module):
    """A module that owns one replicated weight (a norm, a q/k norm, a router)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(shape, dtype=dtype))


def _decoder_norms(layers: int, qk_norms: bool) -> nn.Module:
    """Per layer 2 RMSNorms of 4096 (plus q_norm, k_norm of 128 marked "sum"), and a final norm: fp32."""
    model = nn.Module()
    model.layers = nn.ModuleList()
    for _ in range(layers):
        layer = nn.Module()
        layer.input_layernorm = Holder((4096,), torch.float32)
        layer.post_attention_layernorm = Holder((4096,), torch.float32)
        if qk_norms:
            layer.self_attn = nn.Module()
            layer.self_attn.q_norm = Holder((128,), torch.float32)
            layer.self_attn.k_norm = Holder((128,), torch.float32)
            mark_tp_replica_gradient_reduction(layer.self_attn.q_norm, "sum")
            mark_tp_replica_gradient_reduction(layer.self_attn.k_norm, "sum")
        model.layers.append(layer)
    model.norm = Holder((4096,), torch.float32)
    return model


def llama3_8b_norms() -> nn.Module:
    """(a) Llama-3-8B: 32 layers × 2 RMSNorms + the final norm = 65 vectors of 4096 fp32."""
    return _decoder_norms(32, qk_norms=False)


def qwen3_norms() -> nn.Module:
    """(b) Qwen3-8B-like: 36 layers × (2 norms of 4096 + q_norm, k_norm of 128, marked "sum") + final norm."""
    return _decoder_norms(36, qk_norms=True)


def moe_routers() -> nn.Module:
    """(c) MoE routers: 48 layers × a [128 experts, 2048] fp32 router (Qwen3-30B-A3B-like), 48 MiB."""
    model = nn.Module()
    model.layers = nn.ModuleList()
    for _ in range(48):
        layer = nn.Module()
        layer.gate = Holder((128, 2048), torch.float32)
        model.layers.append(layer)
    return model


def mixed_1000() -> nn.Module:
    """(d) 1,000 tensors, alternately fp32 and bf16, of seeded random sizes summing to 64 MiB of storage."""
    generator = torch.Generator().manual_seed(0)
    weights = torch.empty(1000).log_normal_(0.0, 1.5, generator=generator)
    dtypes = [torch.float32 if i % 2 == 0 else torch.bfloat16 for i in range(1000)]
    element = torch.tensor([4 if d == torch.float32 else 2 for d in dtypes], dtype=torch.float64)
    numels = (weights / weights.sum() * 64 * MIB / element).round().clamp(min=1).long().tolist()
    model = nn.Module()
    model.params = nn.ModuleList(Holder((n,), d) for n, d in zip(numels, dtypes, strict=True))
    return model


SCENARIOS: dict[str, tuple[str, Callable[[], nn.Module]]] = {
    "a": ("Llama-3-8B norms (65 × 4096 fp32)", llama3_8b_norms),
    "b": ("Qwen3 norms + q/k norms (145 tensors)", qwen3_norms),
    "c": ("MoE routers (48 × [128, 2048] fp32)", moe_routers),
    "d": ("1,000 mixed fp32/bf16, 64 MiB", mixed_1000),
}


def deepseek_v3_routers_meta() -> nn.Module:
    """(e, analytic only) DeepSeek-V3-like: 58 MoE routers of [256, 7168] in bf16 on the meta device (203 MiB of
    storage, 406 MiB on the wire in fp32): the one realistic set here larger than one 256 MiB chunk."""
    with torch.device("meta"):
        model = nn.Module()
        model.layers = nn.ModuleList()
        for _ in range(58):
            layer = nn.Module()
            layer.gate = Holder((256, 7168), torch.bfloat16)
            model.layers.append(layer)
    for parameter in model.parameters():
        parameter.grad = torch.empty_like(parameter)
    return model


def _gradients(model: nn.Module) -> list[tuple[str, torch.Tensor, str]]:
    """(name, gradient, reduction) in name order, the same on every rank."""
    out = []
    for module_name, module in model.named_modules():
        reduction = getattr(module, _TP_REPLICA_GRAD_REDUCTION_ATTR, "mean")
        for name, parameter in module.named_parameters(recurse=False):
            out.append((f"{module_name}.{name}", parameter.grad, reduction))
    return sorted(out, key=lambda item: item[0])


def _by_reduction_and_dtype(model: nn.Module) -> dict[tuple[str, torch.dtype], list[torch.Tensor]]:
    groups: dict[tuple[str, torch.dtype], list[torch.Tensor]] = {}
    for _, grad, reduction in _gradients(model):
        groups.setdefault((reduction, grad.dtype), []).append(grad)
    return groups


def _wire_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def _bytes(numel: int, dtype: torch.dtype) -> int:
    return numel * torch.empty((), dtype=dtype).element_size()


@torch.no_grad()
def per_tensor(model: nn.Module, world: int) -> None:
    for _, grad, reduction in _gradients(model):
        dist.all_reduce(grad)
        if reduction == "mean":
            grad.div_(world)


@torch.no_grad()
def flatten(model: nn.Module, world: int) -> None:
    for (reduction, _), grads in _by_reduction_and_dtype(model).items():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        if reduction == "mean":
            flat.div_(world)
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()


def wire_bytes(model: nn.Module) -> int:
    """Bytes ``ours`` all-reduces: every gradient at its fp32 communication size (flags not counted)."""
    return sum(_bytes(g.numel(), _wire_dtype(g.dtype)) for _, g, _ in _gradients(model))


def analytic_peak_bytes(model: nn.Module, variant: str) -> int:
    """Peak bytes of the variant's own buffers alive at once (see the module docstring)."""
    if variant in ("per_tensor", "floor", "precheck"):
        return 0  # in place on the gradients; the floor's buffer *is* the gradient storage
    peak, previous = 0, 0
    for (_, dtype), grads in _by_reduction_and_dtype(model).items():
        chunks = [grads] if variant == "flatten" else _chunks(grads)
        for chunk in chunks:
            numel = sum(g.numel() for g in chunk)
            if variant == "ours":  # one wire-dtype buffer per chunk, freed before the next
                peak = max(peak, _bytes(numel, _wire_dtype(dtype)))
                continue
            cat = _bytes(numel, dtype)
            peak = max(peak, previous + cat)
            previous = cat
    return peak


def _chunks(grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The bounded chunks ``tp_replicas._gradient_chunks`` cuts (at most ``_MAX_FLAT_BUFFER_BYTES`` on the wire)."""
    out: list[list[torch.Tensor]] = []
    chunk: list[torch.Tensor] = []
    size_sum = 0
    for grad in grads:
        size = _bytes(grad.numel(), _wire_dtype(grad.dtype))
        if chunk and size_sum + size > _MAX_FLAT_BUFFER_BYTES:
            out.append(chunk)
            chunk, size_sum = [], 0
        chunk.append(grad)
        size_sum += size
    if chunk:
        out.append(chunk)
    return out


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1])
    return -1


def measured_peak_bytes(fn: Callable[[], None]) -> int | None:
    """Peak resident set above the resident set before ``fn`` (None where VmHWM cannot be reset)."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        return None
    before = _rss_kib("VmRSS:")
    fn()
    return max(0, _rss_kib("VmHWM:") - before) * 1024


def _rank(scenarios: list[str], reps: int) -> dict:
    init_process_group("gloo")
    torch.set_num_threads(1)  # the ranks share the cores
    world = dist.get_world_size()
    mesh: DeviceMesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    results = {}
    for key in scenarios:
        torch.manual_seed(dist.get_rank())
        model = SCENARIOS[key][1]()
        for parameter in model.parameters():
            parameter.grad = torch.randn_like(parameter)
        floor_buffer = torch.randn(wire_bytes(model) // 4, dtype=torch.float32)
        flags = torch.ones(3, sum(1 for _ in model.parameters()), dtype=torch.int32)
        runs: dict[str, Callable[[], None]] = {
            "ours": lambda m=model: synchronize_tp_replica_gradients([m], mesh),
            "per_tensor": lambda m=model: per_tensor(m, world),
            "flatten": lambda m=model: flatten(m, world),
            "floor": lambda b=floor_buffer: dist.all_reduce(b),
            "precheck": lambda f=flags: dist.all_reduce(f),
        }
        times: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for rep in range(WARMUP + reps):
            order = VARIANTS[rep % len(VARIANTS) :] + VARIANTS[: rep % len(VARIANTS)]
            for name in order:
                dist.barrier()
                started = time.perf_counter()
                runs[name]()
                if rep >= WARMUP:
                    times[name].append(time.perf_counter() - started)
        slowest = torch.tensor([times[name] for name in VARIANTS], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        measured = {}
        for name in VARIANTS:
            dist.barrier()
            measured[name] = measured_peak_bytes(runs[name])
        results[key] = {
            "tensors": sum(1 for _ in model.parameters()),
            "wire_bytes": wire_bytes(model),
            "median_s": {name: statistics.median(slowest[i].tolist()) for i, name in enumerate(VARIANTS)},
            "analytic_bytes": {name: analytic_peak_bytes(model, name) for name in VARIANTS},
            "measured_bytes": measured,
        }
        del model, floor_buffer, runs
    dist.destroy_process_group()
    return results


def _mib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / MIB:.1f}"


def run(world_sizes: tuple[int, ...] = (2, 4), scenarios: tuple[str, ...] = tuple(SCENARIOS), reps: int = REPS):
    """Measure every scenario at every world size; print the table and the goal lines; return the goal lines."""
    lines = [
        "### Replica gradient sync (gloo, CPU)",
        "",
        f"Median of {reps} repetitions after {WARMUP} warm-up, slowest rank per repetition. Extra buffer: "
        "analytic peak of the variant's own buffers (measured RSS peak on rank 0 in brackets).",
        "",
        "| set | ranks | tensors | wire MiB | variant | median ms | × floor | extra buffer MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    goals = []
    for world in world_sizes:
        result = launch_local(_rank, world, list(scenarios), reps)[0]
        for key in scenarios:
            r = result[key]
            floor = r["median_s"]["floor"]
            for name in VARIANTS:
                t = r["median_s"][name]
                memory = f"{_mib(r['analytic_bytes'][name])} ({_mib(r['measured_bytes'][name])})"
                lines.append(
                    f"| {key}: {SCENARIOS[key][0]} | {world} | {r['tensors']} | {r['wire_bytes'] / MIB:.1f} "
                    f"| {name} | {t * 1e3:.2f} | {t / floor:.2f} | {memory} |"
                )
            ours = r["median_s"]["ours"]
            ratio = ours / floor
            tag = f"({key}, {world} ranks)"
            goals.append(
                f"{'PASS' if ratio <= FLOOR_RATIO_GOAL else 'MISS'} replica_sync {tag}: ours {ratio:.2f}× "
                f"the floor (goal ≤ {FLOOR_RATIO_GOAL}×)"
            )
            extra = r["analytic_bytes"]["ours"]
            goals.append(
                f"{'PASS' if extra <= BUFFER_GOAL_BYTES else 'MISS'} replica_sync {tag}: extra buffer "
                f"{extra / MIB:.1f} MiB (goal ≤ {BUFFER_GOAL_BYTES // MIB} MiB)"
            )
            if key in SPEEDUP_SCENARIOS:
                speedup = r["median_s"]["per_tensor"] / ours
                goals.append(
                    f"{'PASS' if speedup >= SPEEDUP_GOAL else 'MISS'} replica_sync {tag}: {speedup:.1f}× faster "
                    f"than per-tensor (goal ≥ {SPEEDUP_GOAL:.0f}×)"
                )
    big = deepseek_v3_routers_meta()
    extra = analytic_peak_bytes(big, "ours")
    chunks = len(_chunks([g for _, g, _ in _gradients(big)]))
    lines += [
        "",
        "(e, analytic only, no collective) DeepSeek-V3-like routers, 58 × [256, 7168] bf16, "
        f"{wire_bytes(big) / MIB:.0f} MiB on the wire: {chunks} chunks; extra buffer: ours "
        f"{extra / MIB:.0f} MiB, flatten {analytic_peak_bytes(big, 'flatten') / MIB:.0f} MiB.",
    ]
    goals.append(
        f"{'PASS' if extra <= BUFFER_GOAL_BYTES else 'MISS'} replica_sync (e, analytic): extra buffer "
        f"{extra / MIB:.0f} MiB (goal ≤ {BUFFER_GOAL_BYTES // MIB} MiB)"
    )
    print("\n".join(lines + [""] + goals), flush=True)
    return goals


if __name__ == "__main__":
    run(scenarios=tuple(sys.argv[1:]) or tuple(SCENARIOS))
