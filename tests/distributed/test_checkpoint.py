"""Checkpoints on real gloo ranks: exact resume, resharding to another tp (and to dp or one
process), FSDP2, export.

Every run seeds all ranks alike and draws each global batch from the global torch RNG, so a resume
that did not restore the RNG states would train on other data and fail the exact comparisons. fp32
throughout.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR
from transformers import AutoModelForCausalLM

from components.checkpoint.dcp import MARKER, checkpoint_path, load_checkpoint, save_checkpoint
from components.checkpoint.export import INDEX_FILE, _tied_duplicates, export_hf
from components.checkpoint.integrity import checkpoint_summary, find_resumable
from components.distributed.fsdp import shard_data_parallel
from components.distributed.grads import finalize_dtensor_gradients
from components.distributed.layout import resolve_parallel_dims
from components.distributed.tp_plan import apply_tp_plan
from components.distributed.tp_replicas import (
    broadcast_tp_replicas,
    synchronize_tp_replica_gradients,
)
from components.models import build_causal_lm
from components.models.families import FAMILIES, plan_for
from components.moe import apply_expert_parallel
from components.training.step import forward_backward
from recipes.tiny_models import tiny_config
from tests.harness import mesh

pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled:UserWarning"
)  # the 1-process load

BATCH, SEQ, PROMPT = 4, 16, 3


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / 4)


class Run:
    """A tiny Llama parallelised at (dp, tp) with AdamW and a warmup schedule; plain on one
    process."""

    def __init__(self, world_size: int, tp: int, seed: int, **overrides):
        self.config = tiny_config("llama", **overrides)
        self.model = build_causal_lm(self.config, seed=seed)
        self.mesh = None
        if dist.is_initialized():
            dims = resolve_parallel_dims(world_size, tp=tp)
            self.mesh = mesh((dims.dp, dims.tp), ("dp", "tp"))
            if dims.tp > 1:
                apply_tp_plan(self.model, self.mesh["tp"], plan_for(self.config), self.config)
                broadcast_tp_replicas([self.model], self.mesh)
            if dims.dp > 1:
                shard_data_parallel(self.model, self.mesh["dp"])
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.1)
        self.scheduler = LambdaLR(self.optimizer, warmup)

    @property
    def state(self) -> tuple[nn.Module, torch.optim.Optimizer, LambdaLR]:
        return self.model, self.optimizer, self.scheduler

    def step(self) -> float:
        """One optimizer step on a global batch drawn from the global RNG; the global mean token
        loss."""
        tokens = torch.randint(0, self.config.vocab_size, (BATCH, SEQ))
        labels = tokens.clone()
        labels[:, :PROMPT] = -100
        global_tokens = int((labels[:, 1:] != -100).sum())
        dp_size = 1 if self.mesh is None else self.mesh["dp"].size()
        dp_rank = 0 if self.mesh is None else self.mesh["dp"].get_local_rank()
        self.optimizer.zero_grad()
        local = forward_backward(
            self.model,
            tokens.chunk(dp_size)[dp_rank],
            labels.chunk(dp_size)[dp_rank],
            global_tokens,
        )
        loss = torch.tensor(local, dtype=torch.float64)
        if self.mesh is not None:
            dist.all_reduce(loss, group=self.mesh["dp"].get_group())
            finalize_dtensor_gradients([self.model])
            if self.mesh["tp"].size() > 1:
                synchronize_tp_replica_gradients([self.model], self.mesh)
        self.optimizer.step()
        self.scheduler.step()
        return loss.item() / global_tokens

    def weights(self) -> dict[str, torch.Tensor]:
        """Full parameters by name (a collective for DTensors)."""
        return {name: full(parameter.detach()) for name, parameter in self.model.named_parameters()}

    def moments(self) -> dict[str, torch.Tensor]:
        """Full AdamW state tensors, keyed ``<parameter>.<key>`` (a collective for DTensors)."""
        moments = {}
        for name, parameter in self.model.named_parameters():
            for key, value in self.optimizer.state[parameter].items():
                moments[f"{name}.{key}"] = full(value)
        return moments


def full(tensor: torch.Tensor) -> torch.Tensor:
    """A full copy: a plain tensor is cloned too, or training on would change what was recorded."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.clone()


def check_resume(rank, world_size, root, tp):
    """3 steps, save, 3 more; then a fresh model with other weights and RNG state loads and trains 3
    steps."""
    torch.manual_seed(0)
    run = Run(world_size, tp, seed=0)
    for _ in range(3):
        run.step()
    saved = save_checkpoint(Path(root), 3, *run.state, extra={"samples_seen": 3 * BATCH})
    continued = [run.step() for _ in range(3)]
    if rank == 0:  # a later save that crashed before its rename, and a folder that lost its marker
        shutil.copytree(saved, Path(root) / "step_00000006.tmp")
        shutil.copytree(saved, Path(root) / "step_00000009")
        (Path(root) / "step_00000009" / MARKER).unlink()
    dist.barrier()

    torch.manual_seed(1234)
    fresh = Run(world_size, tp, seed=1)
    state = load_checkpoint(find_resumable(Path(root)).path, *fresh.state)
    resumed = [fresh.step() for _ in range(3)]
    left = sorted(path.name for path in Path(root).iterdir())
    return {
        "saved": saved.name,
        "continued": continued,
        "resumed": resumed,
        "state": state,
        "left": left,
    }


@pytest.mark.parametrize("pool, tp", [("ranks2", 2), ("ranks4", 2)], ids=["tp2", "dp2_tp2_fsdp"])
def test_resume_reproduces_an_uninterrupted_run_exactly(request, tmp_path, pool, tp):
    for index, result in enumerate(
        request.getfixturevalue(pool).run(check_resume, str(tmp_path), tp)
    ):
        assert result["resumed"] == result["continued"], f"rank {index}"
        assert result["state"] == {"step": 3, "samples_seen": 3 * BATCH}
        assert result["saved"] == "step_00000003"
        assert result["left"] == ["step_00000003", "step_00000006.tmp", "step_00000009"]


def check_save_reference(rank, world_size, root, tp=2):
    """Train 3 steps at ``tp``, save, and record the weights, AdamW moments and 2 continued
    losses."""
    torch.manual_seed(0)
    run = Run(world_size, tp, seed=0)
    for _ in range(3):
        run.step()
    save_checkpoint(Path(root) / "checkpoints", 3, *run.state)
    reference = {"weights": run.weights(), "moments": run.moments()}
    reference["continued"] = [run.step() for _ in range(2)]
    if rank == 0:
        torch.save(reference, Path(root) / "reference.pt")


def check_load_resharded(rank, world_size, root, tp):
    """Load the tp=2 checkpoint at another layout: weights and moments must be exact, losses
    close."""
    torch.manual_seed(1234)
    run = Run(world_size, tp, seed=1)
    state = load_checkpoint(checkpoint_path(Path(root) / "checkpoints", 3), *run.state)
    reference = torch.load(Path(root) / "reference.pt")
    weights, moments = run.weights(), run.moments()
    return {
        "state": state,
        "lr": run.scheduler.get_last_lr(),
        "weights_differ": [
            name
            for name, value in reference["weights"].items()
            if not torch.equal(weights[name], value)
        ],
        "moments_differ": [
            name
            for name, value in reference["moments"].items()
            if not torch.equal(moments[name], value)
        ],
        "moments_missing": sorted(set(reference["moments"]) - set(moments)),
        "continued": [run.step() for _ in range(2)],
        "reference_continued": reference["continued"],
    }


def test_load_at_other_tensor_parallel_sizes(ranks2, ranks4, tmp_path):
    ranks2.run(check_save_reference, str(tmp_path))
    with torch.random.fork_rng(devices=[]):
        one_process = check_load_resharded(
            0, 1, str(tmp_path), 1
        )  # no process group: a plain model
    results = {
        "tp4": ranks4.run(check_load_resharded, str(tmp_path), 4),
        "dp2_fsdp": ranks2.run(check_load_resharded, str(tmp_path), 1),
        "one_process": [one_process],
    }
    for layout, ranks in results.items():
        for result in ranks:
            assert result["state"] == {"step": 3}, layout
            assert result["lr"] == [1e-2], layout  # warmup finished at step 3: lambda(3) == 1
            assert result["weights_differ"] == [] and result["moments_differ"] == [], layout
            assert result["moments_missing"] == [], layout
            assert result["continued"] == pytest.approx(result["reference_continued"], rel=1e-5), (
                layout
            )


def gathered_state(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """What the export wrote before it was parallel: the full state dict gathered to rank 0 (empty
    on the others), tied duplicates left out, floating tensors cast to ``dtype``."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    tied = _tied_duplicates(model)
    return {
        name: tensor.to(dtype) if tensor.is_floating_point() else tensor
        for name, tensor in state.items()
        if name not in tied
    }


def stored_state(folder: Path) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Every tensor of an exported folder, and its weight files."""
    files = sorted(path.name for path in folder.glob("*.safetensors"))
    tensors = {}
    for name in files:
        with safe_open(folder / name, framework="pt") as stored:
            tensors.update({key: stored.get_tensor(key) for key in stored.keys()})
    return tensors, files


def upcast(tensor: torch.Tensor) -> torch.Tensor:
    """A stored tensor as from_pretrained of an fp32 model holds it."""
    return tensor.float() if tensor.is_floating_point() else tensor


def compare_export(model, out: Path, reference: dict, tokens, logits, world_size) -> dict:
    """Rank 0's view of an export: bitwise against the gathered state, through from_pretrained."""
    stored, files = stored_state(out)
    exported = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=False)
    loaded = dict(exported.state_dict())
    with torch.no_grad():
        error = (exported(input_ids=tokens).logits - logits).abs().max().item()
    index = json.loads((out / INDEX_FILE).read_text()) if (out / INDEX_FILE).exists() else None
    return {
        "error": error,
        "files": files,
        "index_files": sorted(set(index["weight_map"].values())) if index else None,
        "same_names": sorted(stored) == sorted(reference),
        "differ": [n for n, t in reference.items() if not torch.equal(stored.get(n, t[:0]), t)],
        "dtypes": {str(t.dtype) for t in stored.values()},
        "loaded_differ": [n for n, t in reference.items() if not torch.equal(loaded[n], upcast(t))],
        "lm_head_stored": "lm_head.weight" in stored,
        "tied_in_model": model.lm_head.weight is model.get_input_embeddings().weight,
        "left": sorted(path.name for path in out.parent.iterdir()),
    }


def check_export(rank, world_size, root, tp, tied, dtype=torch.float32):
    """Train 2 steps, export in parallel, compare with the gathered export and the logits."""
    torch.manual_seed(0)
    run = Run(world_size, tp, seed=0, tie_word_embeddings=tied)
    for _ in range(2):
        run.step()
    out = export_hf(run.model, run.config, Path(root) / "exported", dtype=dtype)
    reference = gathered_state(run.model, dtype)
    tokens = torch.randint(
        0, run.config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(3)
    )
    with torch.no_grad():
        logits = full(run.model(input_ids=tokens).logits)
    if rank != 0:
        return None
    return compare_export(run.model, out, reference, tokens, logits.to(dtype).float(), world_size)


def assert_parallel_export(result, world_size, tied=False, dtype="torch.float32"):
    parts = [f"model-{k:05d}-of-{world_size:05d}.safetensors" for k in range(1, world_size + 1)]
    assert result["files"] == parts and result["index_files"] == parts  # one part per rank
    assert result["same_names"] and result["differ"] == [] and result["loaded_differ"] == []
    assert result["dtypes"] == {dtype}
    assert result["left"] == ["exported"]
    assert result["tied_in_model"] is tied and result["lm_head_stored"] is not tied


@pytest.mark.parametrize(
    "pool, tp, tied",
    [("ranks2", 2, False), ("ranks2", 2, True), ("ranks2", 1, False), ("ranks4", 2, False)],
    ids=["tp2", "tp2_tied", "dp2_fsdp", "dp2_tp2"],
)
def test_parallel_export_equals_the_gathered_one_and_loads(request, tmp_path, pool, tp, tied):
    pool = request.getfixturevalue(pool)
    result = pool.run(check_export, str(tmp_path), tp, tied)[0]
    assert result["error"] < 1e-5
    assert_parallel_export(result, pool.world_size, tied)


def test_parallel_export_honours_the_dtype(ranks2, tmp_path):
    result = ranks2.run(check_export, str(tmp_path), 2, False, torch.bfloat16)[0]
    assert_parallel_export(result, 2, dtype="torch.bfloat16")


def check_export_failure(rank, world_size, root):
    """Rank 1 cannot write its part (a full disk): every rank raises after the gathers, and the
    earlier export stays as it was."""
    import components.checkpoint.export as export

    run = Run(world_size, 2, seed=0)
    first = export_hf(run.model, run.config, Path(root) / "exported")
    before = sorted(path.name for path in first.iterdir())
    write = export._PartWriter.write

    def full_disk(self, entry, tensor):
        raise OSError(28, "No space left on device")

    if rank == 1:
        export._PartWriter.write = full_disk  # in this rank's process only; restored below
    try:
        export_hf(run.model, run.config, Path(root) / "exported")
    except Exception as error:
        raised = f"{type(error).__name__}: {error}"
    else:
        raised = None
    finally:
        export._PartWriter.write = write
    return {"raised": raised, "before": before, "after": sorted(p.name for p in first.iterdir())}


def test_a_rank_that_cannot_write_fails_every_rank_and_publishes_nothing(ranks2, tmp_path):
    results = ranks2.run(check_export_failure, str(tmp_path))
    full = "OSError: [Errno 28] No space left on device"
    assert results[1]["raised"] == full
    assert results[0]["raised"] == f"RuntimeError: rank 1 failed: {full}"
    for result in results:
        assert result["after"] == result["before"]


def check_moe_export(rank, world_size, root):
    """A Qwen3-MoE at tp=2, its experts split over ep=2: exported in parallel, as the gathered."""
    config = tiny_config("qwen3_moe")
    experts, routers = FAMILIES["qwen3_moe"].experts, FAMILIES["qwen3_moe"].routers
    dims = resolve_parallel_dims(world_size, tp=world_size, ep=world_size)
    device_mesh = mesh((dims.dp, dims.tp), ("dp", "tp"))
    model = build_causal_lm(config, seed=0)
    apply_tp_plan(model, device_mesh["tp"], plan_for(config), config, moe_modules=experts + routers)
    ep_mesh = mesh((dims.ep_shard, dims.ep), ("ep_shard", "ep"))
    apply_expert_parallel(model, ep_mesh, device_mesh["tp"], list(experts))
    parameters = model.named_parameters()
    sharded = sorted(n for n, p in parameters if ".experts." in n and isinstance(p, DTensor))
    out = export_hf(model, config, Path(root) / "exported")
    reference = gathered_state(model, torch.float32)
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, config.vocab_size, (2, SEQ), generator=generator)
    with torch.no_grad():
        logits = full(model(input_ids=tokens).logits)
    if rank != 0:
        return None
    return compare_export(model, out, reference, tokens, logits, world_size) | {"sharded": sharded}


def test_parallel_export_of_experts_split_over_ep(ranks2, tmp_path):
    result = ranks2.run(check_moe_export, str(tmp_path))[0]
    assert len(result["sharded"]) == 4  # 2 layers x gate_up_proj, down_proj: split by expert
    assert result["error"] < 1e-5
    assert_parallel_export(result, 2)


def check_damaged_shard_falls_back(rank, world_size, root):
    """Two checkpoints at tp=2 (pruned by run id), rank 1's shard of the newer one truncated: the
    choice is the older one, every rank loads it, and the summary records the global shapes of the
    sharded model."""
    torch.manual_seed(0)
    run = Run(world_size, 2, seed=0)
    info = {"optimizer": "AdamW"}
    for number in (1, 2, 3):
        run.step()
        save_checkpoint(
            Path(root),
            number,
            *run.state,
            keep=2,
            run_id="ours",
            run_info=info,
            extra={"n": number},
        )
    shard = checkpoint_path(Path(root), 3) / "__1_0.distcp"
    size = [shard.stat().st_size]
    dist.barrier()
    if rank == 0:
        shard.write_bytes(shard.read_bytes()[:100])
    dist.barrier()
    choice = find_resumable(Path(root))
    fresh = Run(world_size, 2, seed=1)
    return {
        "left": sorted(path.name for path in Path(root).iterdir()),
        "size": size[0],
        "choice": choice.path.name,
        "skipped": [(path.name, cause) for path, cause in choice.skipped],
        "state": load_checkpoint(choice.path, *fresh.state),
        "summary": checkpoint_summary(choice.path),
        "shapes": {
            name: tuple(tensor.shape)
            for name, tensor in Run(1, 1, seed=0).model.state_dict().items()
        },
    }


def test_a_damaged_shard_falls_back_to_the_previous_checkpoint(ranks2, tmp_path):
    for result in ranks2.run(check_damaged_shard_falls_back, str(tmp_path)):
        assert result["left"] == ["step_00000002", "step_00000003"]
        assert result["choice"] == "step_00000002"
        cause = f"__1_0.distcp is truncated (100 bytes, its metadata needs {result['size']})"
        assert result["skipped"] == [("step_00000003", cause)]
        assert result["state"] == {"step": 2, "n": 2}
        summary = result["summary"]
        assert (summary.step, summary.world_size, summary.run_id, summary.run_info) == (
            2,
            2,
            "ours",
            {"optimizer": "AdamW"},
        )
        assert summary.parameter_shapes == result["shapes"]
