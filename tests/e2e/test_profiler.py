"""``profile.steps`` through the real command line: a tp=2 run writes one Chrome trace per rank
holding the asked steps (and only those), and a bad request is refused with one ``error:`` line
before any rank starts.

Everything here runs in ``make test`` (no ``sweep`` cases): two profiled tp=2 dp=2 runs of 2 steps
(a module fixture shared by the first two tests) and three refusals."""

import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from components.runtime.output_dir import run_files
from components.training.profiler import HOST_SYNC, OPTIMIZER_STEP, host_syncs_per_step
from tests import cli

pytestmark = pytest.mark.timeout(900)

REPO = Path(__file__).resolve().parents[2]
OUR_READS, TRACED = 2, 0  # a step's reads of the device from our code, per rank (the test below)
COMMON = [
    "train.max_steps=3",
    "train.warmup_steps=1",
    "train.global_batch_size=8",
    "train.micro_batch_size=4",
    "train.val_every=0",
    "checkpoint.export=false",
    "data.num_examples=200",
]


# Imported by every Python process started with its folder on PYTHONPATH: logs each read of a
# tensor's value on the host made from components/ or recipes/ inside the recipe's train_step, with
# the pid and the step (0-based) of that train_step.
READS_LOGGED = """
import os, sys, torch

def _step(frame):
    while frame is not None:
        code = frame.f_code
        if code.co_name == "train_step" and code.co_filename.endswith("finetune_rank.py"):
            return frame.f_locals.get("step")
        frame = frame.f_back
    return None

def _logged(owner, name):
    original = getattr(owner, name)
    def read(*args, **kwargs):
        caller, repo = sys._getframe(1), os.environ.get("COUNT_REPO")  # read late: a warm fork's
        ours = repo and os.path.abspath(caller.f_code.co_filename).startswith(
            (os.path.join(repo, "components") + os.sep, os.path.join(repo, "recipes") + os.sep)
        )
        if ours and (step := _step(caller)) is not None:
            with open(os.environ["COUNT_LOG"], "a") as log:
                where = f"{caller.f_code.co_filename}:{caller.f_lineno}"
                log.write(f"{os.getpid()} {step} {name} {where}\\n")
        return original(*args, **kwargs)
    setattr(owner, name, read)

for _name in ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__"):
    _logged(torch.Tensor, _name)
_logged(torch, "equal")
"""


def recipe(output_dir: Path, *overrides: str, environment: dict | None = None):
    command = [sys.executable, "recipes/finetune.py", *COMMON, f"output_dir={output_dir}"]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **(environment or {})}
    return cli.run(
        [*command, *overrides],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env=environment,
    )


def _ours(events: list[dict], step: int) -> int:
    """Step ``step``'s host syncs among a trace's ``events`` whose nearest Python caller (past
    built-ins and the READS_LOGGED wrapper) is our code (the others: torch's, transformers')"""
    (span,) = [e for e in events if e.get("name") == f"ProfilerStep#{step}"]
    syncs = [
        event
        for event in events
        if event.get("name") == HOST_SYNC and 0 <= event["ts"] - span["ts"] <= span["dur"]
    ]
    frames = [
        event
        for event in events
        if event.get("cat") == "python_function"
        and not event["name"].startswith("<built-in")
        and "sitecustomize" not in event["name"]
    ]
    count = 0
    for tid in {sync["tid"] for sync in syncs}:
        mine = [frame for frame in frames if frame["tid"] == tid]
        mine.sort(key=lambda frame: (frame["ts"], -frame["dur"]))  # outermost first
        at = sorted((sync for sync in syncs if sync["tid"] == tid), key=lambda sync: sync["ts"])
        callers = _innermost(mine, at)
        count += sum(caller["name"].startswith((str(REPO), "recipes/")) for caller in callers)
    return count


def _innermost(frames: list[dict], syncs: list[dict]) -> list[dict]:
    """Per sync (in time order), the innermost of one thread's ``frames`` (outermost first) open
    at its time, in one sweep: the frames begun by then are stacked in that order, and a frame
    that closed before one sync is open at no later one, so it leaves the stack for good."""
    stack, callers, begun = [], [], 0
    for sync in syncs:
        while begun < len(frames) and 0 <= sync["ts"] - frames[begun]["ts"]:
            stack.append(frames[begun])
            begun += 1
        while not sync["ts"] - stack[-1]["ts"] <= stack[-1]["dur"]:
            stack.pop()
        callers.append(stack[-1])
    return callers


def counting(output_dir: Path) -> dict[str, str]:
    """The environment of a run into ``output_dir`` whose reads READS_LOGGED logs: one site folder
    for every run, so one warm interpreter (tests/cli.py)."""
    site = output_dir.parent / "site"
    path = os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {"PYTHONPATH": path, "COUNT_REPO": str(REPO), "COUNT_LOG": str(output_dir / "reads.log")}


@pytest.fixture(scope="module")
def profiled(tmp_path_factory) -> dict:
    """The two runs of :func:`_profiled` (1 micro-batch of 4 per dp rank; 2 of 2 with sp), the
    first into the folder a request for step 0 was refused from (that refusal's result too)."""
    root = tmp_path_factory.mktemp("profiled")
    (root / "site").mkdir()
    (root / "site" / "sitecustomize.py").write_text(READS_LOGGED)
    with ThreadPoolExecutor(2) as pool:  # two at a time: much of a run is its start-up
        twice = pool.submit(_profiled, root / "twice", micro_batch_size=2, sp=True)
        step_0 = ["tp=2", "profile.steps=[0,2]"]
        refused = recipe(root / "once", *step_0, environment=counting(root / "once"))
        left = run_files(root / "once")
        once = pool.submit(_profiled, root / "once", micro_batch_size=4, sp=False)
        results = {"once": once.result(), "twice": twice.result()}
    return results | {"refused": refused, "left": left, "folder": root / "once"}


def _profiled(output_dir: Path, micro_batch_size: int, sp: bool) -> tuple[list[int], list[int]]:
    """A tp=2 dp=2 run of 2 steps, step 2 profiled, with READS_LOGGED: per rank (sorted), step 2's
    reads our code made, and its trace's host syncs from our code, once each trace is checked to
    be Chrome trace JSON holding that step alone, the model and the update."""
    log = output_dir / "reads.log"
    overrides = [
        "tp=2",
        "dp=2",
        f"sp={str(sp).lower()}",
        "train.max_steps=2",
        "profile.steps=[2,2]",
    ]
    overrides.append(f"train.micro_batch_size={micro_batch_size}")
    result = recipe(output_dir, *overrides, environment=counting(output_dir))
    assert result.returncode == 0, result.stderr[-4000:]
    folder, traced = output_dir / "profile", []
    assert sorted(path.name for path in folder.iterdir()) == [
        f"rank{rank}.pt.trace.json" for rank in range(4)
    ]
    for rank in range(4):
        trace = folder / f"rank{rank}.pt.trace.json"
        events = json.loads(trace.read_text())["traceEvents"]  # valid Chrome trace JSON
        names = {event.get("name") for event in events}
        steps = {name for name in names if str(name).startswith("ProfilerStep#")}
        assert steps == {"ProfilerStep#2"}, (rank, steps)
        assert {"aten::mm", "Optimizer.step#AdamW.step"} <= names, rank  # the model and update
        traced.append(_ours(events, 2))
        if rank == 0:  # the trace's count leaves the optimizer's out and holds ours
            assert host_syncs_per_step(trace, apart=OPTIMIZER_STEP)[2] >= traced[0]
    lines = [line.split() for line in log.read_text().splitlines()]
    pids = {line[0] for line in lines}
    assert len(pids) == 4, lines  # step 1's reads, at least, on every rank
    reads = sorted(sum(line[:2] == [pid, "1"] for line in lines) for pid in pids)
    return reads, sorted(traced)


def test_a_step_reads_the_device_the_same_times_whatever_its_accumulation(profiled):
    """tp=2 dp=2, 8 sequences a step: 1 micro-batch of 4 per dp rank, then 2 of 2 with sequence
    parallelism (its norms' Partial gradients finalised). Our code reads the device OUR_READS times
    in step 2 on each rank either way: the replica sync's presence flags (before its all-reduce, as
    the spec says) and every other value of the step at once before the update, the grad norm and
    the finalisation's checks among them (``components/training/readout.py``; the finalisation
    reads at step 1 only, ``components/distributed/step_finalizer.py``). Neither is an ``item()``
    (``tolist`` and ``torch.equal`` run no ``aten::_local_scalar_dense``): TRACED in the trace. Not
    ours, not counted: AdamW's reads of its step counters (CPU tensors, no device wait), and per
    micro-batch torch's vocab-parallel embedding (2) and transformers' packed-sequence check (1)."""
    once, twice = profiled["once"], profiled["twice"]
    assert once == twice == ([OUR_READS] * 4, [TRACED] * 4), (once, twice)


def test_step_0_is_refused_in_its_list_and_the_corrected_run_profiles_into_that_folder(profiled):
    """``profile.steps=[0,2]`` is one line naming the list, the wrong step and what works, before
    anything is claimed: the corrected run (``[2,2]``) then profiles into the same folder."""
    refused = profiled["refused"]
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1, refused.stderr[-2000:]
    assert lines[0] == (
        "error: profile.steps=[0, 2] is not valid (its item 1 is 0: input should be greater than "
        "or equal to 1): use null (off) or [FIRST, LAST], 1-based steps of the run, e.g. "
        "profile.steps=[2,3]"
    )
    assert profiled["left"] == []  # nothing claimed: the corrected run is not "another run's"
    folder = profiled["folder"]  # the corrected run's traces and reads are checked in _profiled
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records] == [1, 2]


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["profile.steps=[2,4]"], "profile.steps=[2,4] goes past the run's last step (3)"),
        (["profile.steps=[3,2]"], "profile.steps=[3,2] is not a range"),
        pytest.param(
            ["profile.memory=true", "profile.steps=[1,2]"],
            "profile.memory=true is a CUDA memory snapshot: not supported on the CPU",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA takes it"),
        ),
    ],
)
def test_a_bad_request_is_one_error_line_before_any_rank_starts(tmp_path, overrides, says):
    result = recipe(tmp_path / "run", "tp=2", *overrides)
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and len(lines) == 1, result.stderr[-2000:]
    assert lines[0].startswith("error: ") and says in lines[0], lines[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
