"""The run plan: every decision of a run, made once in the launching process and read by every rank.

Ranks never re-derive what is here (paths, sizes, the checkpoint to resume, the data, the model's
config): they get this frozen object, handed over in memory by the local launcher or rebuilt by each
torchrun rank from the same checks.
"""

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from components.data import PreparedData
from components.debug.faults import Fault
from components.distributed.mesh import ParallelDims
from components.models.parallelize import ModelSpec
from recipes.schema import Config


@dataclass(frozen=True, kw_only=True)
class RunPlan:
    settings: Config  # every key of the composed config, validated (types, ranges, known keys)
    dims: ParallelDims
    device_type: str  # "cpu" or "cuda"
    cpu_threads: int  # intra-op threads per rank on the CPU
    output_dir: Path  # absolute; this run owns it while it runs
    # the Hugging Face config (vocabulary size included), the weights' folder, how to split it
    model: ModelSpec
    tokenizer_dir: Path
    data: PreparedData  # the tokenized splits, prepared once, memory-mapped by the ranks
    pad_multiple: int  # a micro-batch is padded to its longest row, rounded up to this multiple
    loss_chunk_tokens: int  # train.loss_chunk_tokens: tokens per lm_head + loss chunk; 0: unchunked
    warmup_steps: int  # train.warmup_steps, cut to train.max_steps when longer (with a note:)
    resume_from: (
        Path | None
    )  # the checkpoint chosen before any rank started, or None for a fresh run
    run_id: (
        str | None
    )  # this run's id (checkpoints record it; pruning touches only its own); None: ask rank 0
    # what checkpoints record and a resume must match (model shapes, optimizer, batch geometry)
    run_info: dict
    fault: Fault | None  # debug.fault, parsed (tests only)
    config_yaml: (
        str  # the resolved config the run was started with, saved as output_dir/config.yaml
    )

    @cached_property
    def flops_per_token(self) -> int:
        """Model FLOPs of forward + backward per token at ``train.seq_len`` (for ``mfu``)."""
        from components.planning.flops import flops_per_token

        return flops_per_token(self.model.config, self.settings.train.seq_len)

    @property
    def checkpoints(self) -> Path:
        return self.output_dir / "checkpoints"
