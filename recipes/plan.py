"""The run plan: every decision of a run, made once in the launching process and read by every rank.

Ranks never re-derive what is here (paths, sizes, the checkpoint to resume, the data, the model's
config): they get this frozen object, handed over in memory by the local launcher or rebuilt by each
torchrun rank from the same checks.
"""

from __future__ import annotations  # the field types are only read by a type checker

from dataclasses import dataclass
from datetime import timedelta
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from components.distributed.mesh import ParallelDims
from recipes.schema import Checkpoint, Moe, Optim, Schedule, Targeted, Train

if TYPE_CHECKING:  # heavy (datasets, DTensor): the checks import them when they need them
    from components.data import PreparedData
    from components.debug.faults import Fault
    from components.models.parallelize import ModelSpec


@dataclass(frozen=True, kw_only=True)
class RunPlan:
    dims: ParallelDims
    device_type: str  # "cpu" or "cuda"
    cpu_threads: int  # intra-op threads per rank on the CPU
    seed: int
    collective_timeout: timedelta  # a collective waiting longer fails the run
    output_dir: Path  # absolute; this run owns it while it runs
    # the Hugging Face config (vocabulary size included), the weights' folder, how to split it
    model: ModelSpec
    base_model: str | None  # model.pretrained_path, as the export's model card names it
    tokenizer_dir: Path
    data: PreparedData  # the tokenized splits, prepared once, memory-mapped by the ranks
    pad_multiple: int  # a micro-batch is padded to its longest row, rounded up to this multiple
    # train.*, decided: warmup_steps cut to max_steps (with a note:), loss_chunk_tokens 0 for off
    train: Train
    optim: Optim
    schedule: Schedule
    checkpoint: Checkpoint  # saves, pruning, export; the resume itself is decided: resume_from
    logger: Targeted
    moe: Moe
    check_replicas_every: int  # debug.check_replicas_every
    max_restarts: int  # the recipe's own launcher restarts every rank up to this many times
    dry_run: bool  # plan the layout on fake ranks and exit
    device_memory_gib: float | None  # with dry_run: one device's memory (None: the visible one's)
    resume_from: Path | None  # the checkpoint chosen before any rank started, or None
    run_id: str | None  # this run's id (checkpoints record it); None: ask rank 0
    # what checkpoints record and a resume must match (model shapes, optimizer, batch geometry)
    run_info: dict
    fault: Fault | None  # debug.fault, parsed: a resilience drill (docs/fault-injection.md)
    config_yaml: str  # the resolved config the run was started with (output_dir/config.yaml)

    @cached_property
    def flops_per_token(self) -> int:
        """Model FLOPs of forward + backward per token at ``train.seq_len`` (for ``mfu``)."""
        from components.planning.flops import flops_per_token

        return flops_per_token(self.model.config, self.train.seq_len)

    @property
    def checkpoints(self) -> Path:
        return self.output_dir / "checkpoints"
