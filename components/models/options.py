"""The values a model's build options take, listed once: the config's schema offers them and the
builders dispatch on them; and what the model's checks read of a run (``components/models/
checks.py``). Imports nothing heavy, so a config is checked without loading a model."""

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PRECISIONS = ("fp32", "bf16-mixed", "bf16", "fp8")  # train.precision (components.models.precision)
FP8_RECIPES = ("tensorwise", "rowwise")  # train.fp8_recipe (components.models.fp8)
# train.activation_checkpointing (components.models.activation_checkpointing)
ACTIVATION_CHECKPOINTING = ("none", "full", "selective")
# model.attn_implementation (components.models.attention); PACKED_NATIVE take packed rows as
# sequence boundaries (cumulative lengths, a block mask), never as a dense sequence × sequence mask
# train.cpu_offload=true where host and device memory are one: the run's note and the dry run's
# plan line both say it
OFFLOAD_ON_THE_CPU = (
    "train.cpu_offload=true moves nothing on the CPU (host and device memory are one): FSDP wraps "
    "the model at dp=1 too"
)
PACKED_NATIVE = ("flash_attention_2", "flash_attention_3", "flex_attention")
ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager", *PACKED_NATIVE)


@dataclass(frozen=True, kw_only=True)
class ModelChoice:
    """The ``model`` group: where the model comes from, its family's sizes, its experts."""

    name: str  # model=NAME, as messages name it
    family: str | None
    config: dict[str, Any]  # model.config: the family's sizes (not read for a folder)
    attn_implementation: str | None  # None: transformers' default (sdpa, else eager)
    pretrained_path: str | None = None  # a local folder or a Hub id
    source: str | None = None  # a named source (smollm2)
    experts: Sequence[str] | None = None  # module patterns; None: the family's
    routers: Sequence[str] | None = None
    cache_dir: Path | None = None  # where model.source=smollm2 is converted; None: the default


@dataclass(frozen=True, kw_only=True)
class LoraTargets:
    """``peft=lora``'s targets: linear-layer patterns (None: the projections), and experts; and
    whether the export merges them into the base (``peft.merge``)."""

    target_modules: tuple[str, ...] | None
    experts: bool
    merged: bool = False


@dataclass(frozen=True, kw_only=True)
class ModelUse:
    """What the run asks of the model."""

    seq_len: int
    sequence_parallel: bool
    precision: str
    compile: bool
    device_type: str
    lora: LoraTargets | None  # None: no adapters (or peft's own keys are refused)
    peft_lora: bool  # peft=lora or qlora, checked or not (fp8 refuses it either way)
    nf4_base: bool = False  # peft=qlora: the adapted linears' base stored in NF4
    packing: bool  # train.packing: examples packed in a row, their positions restarting
    # the other degrees a dry run may suggest, as (tp, cp or pp, size): what the model's checks
    # refuse there is found too (CheckedModel.refusals)
    other_layouts: tuple[tuple[str, int], ...] = ()
