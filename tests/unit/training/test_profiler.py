"""The profiler on request: the ``profile`` keys' checks, and a real torch.profiler trace of the
asked steps alone, each a ``ProfilerStep#N`` range whose host syncs the bench can count."""

import json

import pytest
import torch

from components.training.profiler import StepProfiler, host_syncs_per_step, profile_errors


@pytest.mark.parametrize(
    ("steps", "memory", "device", "says"),
    [
        ([3, 2], False, "cpu", "profile.steps=[3,2] is not a range"),
        ([2, 7], False, "cpu", "profile.steps=[2,7] goes past the run's last step (6)"),
        (None, True, "cuda", "profile.memory=true snapshots the profiled steps"),
        ([1, 2], True, "cpu", "profile.memory=true is a CUDA memory snapshot: not supported on"),
    ],
)
def test_a_bad_profile_request_is_one_sentence_naming_the_key(steps, memory, device, says):
    errors = profile_errors(steps, memory, 6, device)
    assert len(errors) == 1 and errors[0].startswith(says), errors


@pytest.mark.parametrize(
    ("steps", "memory", "device"),
    [(None, False, "cpu"), ([1, 6], False, "cpu"), ([6, 6], True, "cuda")],
)
def test_a_range_within_the_run_is_accepted(steps, memory, device):
    assert profile_errors(steps, memory, 6, device) == []


def _work(step: int) -> None:
    """Step ``step``'s work: ``step`` values read on the host."""
    values = torch.arange(10.0)
    for index in range(step):
        (values * index).sum().item()


def _steps(profiler: StepProfiler, first: int, last: int) -> None:
    """Steps ``first``..``last`` (1-based), as the train loop steps the profiler."""
    for step in range(first, last + 1):
        _work(step)
        profiler.step(step)


def test_the_trace_holds_the_asked_steps_alone_with_their_host_syncs(tmp_path):
    profiler = StepProfiler([2, 3], False, tmp_path, rank=1, done=0)
    _steps(profiler, 1, 5)
    profiler.close()  # nothing left running: the trace was written after step 3
    trace = tmp_path / "profile" / "rank1.pt.trace.json"
    events = json.loads(trace.read_text())["traceEvents"]
    names = {event.get("name") for event in events}
    assert {"ProfilerStep#2", "ProfilerStep#3"} <= names and "ProfilerStep#1" not in names
    assert "ProfilerStep#4" not in names
    assert any("Input Dims" in event.get("args", {}) for event in events)  # record_shapes
    assert any(event.get("cat") == "python_function" for event in events)  # with_stack
    assert host_syncs_per_step(trace) == {2: 2, 3: 3}


def test_a_resumed_run_profiles_what_is_left_and_a_stop_writes_what_was_recorded(tmp_path):
    profiler = StepProfiler([2, 5], False, tmp_path, rank=0, done=2)  # resumed after step 2
    _steps(profiler, 3, 3)
    _work(4)  # a stop signal after step 4: the loop breaks before it steps the profiler
    profiler.close()
    assert host_syncs_per_step(tmp_path / "profile" / "rank0.pt.trace.json") == {3: 3, 4: 4}


def test_without_steps_nothing_is_written(tmp_path):
    profiler = StepProfiler(None, False, tmp_path, rank=0, done=0)
    _steps(profiler, 1, 3)
    profiler.close()
    assert not (tmp_path / "profile").exists()
