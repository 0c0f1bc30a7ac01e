"""On CUDA the launcher gives each local rank a visible GPU of its own: too many ranks is one
problem before any starts, and the default nproc is the most GPUs the run's batch splits over."""

import pytest

import components.runtime.world as world
from components.debug.faults import fault_backend_errors, parse_fault
from recipes.checks import check_sizes
from recipes.compose import compose
from recipes.validate import validate


def sizes_on(gpus: int, overrides: list[str]):
    dims, found = check_sizes(validate(compose(overrides)), "cuda", gpus)
    return dims, [f"{problem.key}: {problem.message}" for problem in found]


@pytest.mark.parametrize(("gpus", "world"), [(1, 1), (2, 2), (4, 2), (8, 2)])
def test_make_runs_recipe_fits_the_default_nproc_on_1_2_4_or_8_gpus(gpus, world, capsys):
    dims, found = sizes_on(gpus, [])
    assert found == [] and dims.world_size == world and dims.dp == world
    note = capsys.readouterr().out
    assert (f"note: nproc={world} of the {gpus} visible GPUs" in note) == (world < gpus)


def test_the_default_nproc_takes_every_gpu_the_batch_splits_over():
    dims, found = sizes_on(8, ["train.global_batch_size=64", "tp=2"])
    assert found == [] and (dims.world_size, dims.dp, dims.tp) == (8, 4, 2)


@pytest.mark.parametrize(
    ("gpus", "overrides", "ranks"),
    [(1, ["nproc=2"], 2), (2, ["tp=4"], 4), (4, ["dp=2", "cp=2", "tp=2"], 8)],
)
def test_more_ranks_than_visible_gpus_is_one_problem(gpus, overrides, ranks, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(gpus))))
    dims, found = sizes_on(gpus, overrides)
    shown = ",".join(map(str, range(gpus)))
    verb = "is" if gpus == 1 else "are"
    assert dims is None and found == [
        f"nproc: {ranks} ranks on this machine need a GPU each but {gpus} {verb} visible "
        f"(CUDA_VISIBLE_DEVICES={shown}): use nproc={gpus} or fewer (with dp, cp and tp to match), "
        "or torchrun across machines"
    ]


def test_a_dry_run_plans_any_layout_whatever_the_gpus():
    dims, found = sizes_on(1, ["dry_run=true", "tp=4"])
    assert found == [] and dims.world_size == 4


def test_gpus_are_counted_without_cuda_when_torch_has_none():
    assert world.visible_gpus() == 0  # this CPU build: no NVML look-up at all


def test_nvml_counts_the_gpus_where_it_can(monkeypatch):
    monkeypatch.setattr(world.torch.cuda, "_is_compiled", lambda: True)
    monkeypatch.setattr(world, "_nvidia_driver_present", lambda: True)
    monkeypatch.setattr(world.torch.cuda, "_device_count_nvml", lambda: 4)
    assert world.visible_gpus() == 4
    monkeypatch.setattr(world.torch.cuda, "_device_count_nvml", lambda: -1)  # MIG UUIDs
    monkeypatch.setattr(world, "_gpus_counted_in_a_child", lambda: 1)
    assert world.visible_gpus() == 1
    monkeypatch.setattr(world, "_nvidia_driver_present", lambda: False)
    assert world.visible_gpus() == 0


def test_the_fault_that_needs_gloo_is_refused_on_cuda_only():
    fault = parse_fault("kill_in_collective@2")
    assert fault_backend_errors(fault, "cpu") == []
    assert fault_backend_errors(fault, "cuda") == [
        "debug.fault=kill_in_collective@2 is gloo-only (a CPU run): on NCCL a rank never waits in "
        "wait_tensor; use kill@2 or kill_in_save@2 on CUDA"
    ]
    assert fault_backend_errors(parse_fault("kill@2"), "cuda") == []


def test_cpu_offload_on_the_cpu_is_a_note_that_it_moves_nothing():
    train = validate(compose(["train.cpu_offload=true"])).train
    [note] = train.offload_notes("cpu")
    assert note.startswith("train.cpu_offload=true moves nothing on the CPU (host and device ")
    assert train.offload_notes("cuda") == []
    assert validate(compose([])).train.offload_notes("cpu") == []
