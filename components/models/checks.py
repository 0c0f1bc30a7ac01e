"""The model's checks, before any weight is loaded: the folder or the config, what the config
cannot run, the adapters' targets, the TP plan and the sizes tp must divide, fp8's layers, compile,
a pipeline stage's structure, all on one weightless (meta-device) build. A folder still to be
downloaded or converted (``awaits_fetch``) is the preparation's effect, and checked after it.

The model comes from the ``model`` group (:class:`ModelChoice`); what the run asks of it is
:class:`ModelUse`. The parallel layout's own rules are ``components/distributed/layout.py``'s;
expert parallelism's are ``components/moe``'s.
"""

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import transformers

from components.distributed.context_parallel import attention_problems
from components.distributed.layout import (
    LayoutError,
    ModelFacts,
    ParallelDims,
    tp_size_problems,
    tp_sizes,
)
from components.distributed.pipeline import stage_structure_problem
from components.distributed.tp_plan import check_plan
from components.models.attention import attention_choice_problems, set_attention
from components.models.build import meta_causal_lm
from components.models.compile import check_compile
from components.models.configs import (
    build_config,
    config_errors,
    routing_errors,
    vocab_size_errors,
)
from components.models.families import config_rule_errors, moe_patterns, plan_for
from components.models.folder_check import check_model_folder, check_tokenizer_folder
from components.models.fp8 import fp8_problems, fp8_shape_errors
from components.models.hub import needs_download, resolve_model_folder
from components.models.load import (
    causal_flags,
    causal_problems,
    load_config,
    position_offset_problems,
    sequence_problems,
)
from components.models.lora import LoraOptions, apply_lora, targeted_experts, targeted_linears
from components.models.options import LoraTargets, ModelChoice, ModelUse
from components.models.qlora import nf4_problems
from components.models.smollm2 import smollm2_converted, smollm2_folder
from components.problems import Problem, problems


@dataclass(kw_only=True)
class CheckedModel:
    """What the model checks found: the folder (None: built from its config), the config, the meta
    model they built (None when nothing needed one), the problems and the notes to print;
    ``complete``: every check ran (not stopped at a config or a model that cannot be built)."""

    complete: bool = False
    path: Path | None = None
    config: Any = None
    meta: Any = None
    experts: tuple[str, ...] = ()
    awaits_fetch: bool = False  # the folder is yet to be downloaded or converted: checked then
    facts: ModelFacts | None = None  # what the layout's rules read of it, once every check ran
    refusals: dict[tuple[str, int], tuple[str, ...]] = field(default_factory=dict)  # ModelFacts'
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def check_model(choice: ModelChoice, use: ModelUse, dims: ParallelDims | None) -> CheckedModel:
    """The model of ``choice`` checked for ``use`` at the layout ``dims`` (None: the sizes were
    refused), all problems at once."""
    checked = _config(choice)
    if checked.config is None:
        return checked
    config, found = checked.config, checked.problems
    found += config_problems(config, checked.path, use.seq_len)
    found += cp_problems(choice, use, 1 if dims is None else dims.cp, config)
    found += problems("train.packing", sequence_problems(config, 1, use.packing))
    found += problems("model", position_offset_problems(config))
    found += problems("model", causal_problems(config))
    splits = dims is not None and (dims.tp > 1 or dims.ep > 1)
    fp8 = use.precision == "fp8"
    try:
        wanted = checked.path is not None or splits or use.lora is not None or fp8
        wanted = wanted or bool(use.other_layouts)  # a dry run's, checked on the structure
        meta = meta_causal_lm(config) if wanted else None
    except ValueError as error:  # a config class AutoModelForCausalLM does not map
        said = str(error).split("Model type should be one of")[0].strip()  # not the long list
        found.append(Problem(key="model", message=f"transformers: {said}"))
        return checked
    except (AttributeError, TypeError, KeyError, IndexError, ImportError) as error:
        found.append(_unbuildable(config, error))
        return checked
    experts, routers = moe_patterns(config, choice.experts, choice.routers)
    checked.experts = tuple(experts)
    if checked.path is not None:
        meta = _causal(config, meta, checked)
        rows = meta.get_input_embeddings().num_embeddings
        folder = check_model_folder(checked.path, meta) + check_tokenizer_folder(checked.path, rows)
        found += problems("model", folder)
    if use.lora is not None:  # the adapters' targets, on the converted model the TP plan then sees
        found += lora_problems(meta, use.lora, checked.experts, choice.name)
    checked.meta = meta
    if dims is not None:
        moe = (tuple(experts), tuple(routers))
        found += _layout_problems(config, meta, use, dims, moe)
        checked.refusals = other_layout_refusals(choice, config, meta, use, dims, moe)
    checked.complete = True
    return checked


def _config(choice: ModelChoice) -> CheckedModel:
    """The folder (a local one, the Hub's, SmolLM2's conversion) and its config, or the config
    built from the family's sizes."""
    checked = CheckedModel()
    try:
        if awaits_fetch(choice):  # checked once the preparation has made the folder
            checked.awaits_fetch = True
        elif choice.pretrained_path is not None or choice.source is not None:
            if choice.config:  # the group's sizes (or a user's overrides) do not apply
                checked.notes.append(
                    f"note: model.config of model={choice.name} is not used: the folder's "
                    "config.json decides"
                )
            checked.path = fetch_model_folder(choice)  # no effect here: a folder there already
            checked.config = load_config(checked.path)
        elif errors := config_errors(choice.family, choice.config) + vocab_size_errors(
            choice.config
        ):
            checked.problems = problems("model.config", errors)
        else:
            checked.config = build_config(choice.family, choice.config)
    except (ValueError, OSError, RuntimeError) as error:
        checked.path, checked.config = None, None
        checked.problems = [Problem(key="model", message=str(error))]
    return checked


def kernel_problems(choice: ModelChoice, use: ModelUse, cp: int, config) -> list[Problem]:
    """``model.attn_implementation`` checked for this run at context parallel size ``cp``, then
    set on ``config`` (left as it is when refused: a kernel not installed would fail the build
    too); ``model.config.attn_implementation``, a second key for it, refused."""
    chosen = choice.attn_implementation
    found = attention_choice_problems(chosen, config, use.device_type, use.precision, cp)
    if not found:
        set_attention(config, chosen)
    refused = problems("model.attn_implementation", found)
    if "attn_implementation" in choice.config:
        given = choice.config["attn_implementation"]
        message = (
            f"model.config.attn_implementation={given} is refused: the attention kernel is set "
            f"once, by model.attn_implementation; use model.attn_implementation={given}"
        )
        refused.append(Problem(key="model.config.attn_implementation", message=message))
    return refused


def awaits_fetch(choice: ModelChoice) -> bool:
    """Whether the chosen folder is still to be made: a Hub id to download, SmolLM2 to convert
    into ``cache_dir``. The checks leave that effect to the preparation, which checks it then."""
    if choice.pretrained_path is None:  # model.source=smollm2
        return choice.source is not None and not smollm2_converted(choice.cache_dir)
    return needs_download(choice.pretrained_path)


def fetch_model_folder(choice: ModelChoice, key: str = "model.pretrained_path") -> Path:
    """The chosen model's folder: a local one, a Hub id from the cache or downloaded, SmolLM2's
    conversion into ``cache_dir``. Raises ValueError or RuntimeError, one line (naming ``key``,
    the path's setting)."""
    if choice.pretrained_path is None:  # model.source=smollm2
        return smollm2_folder(choice.cache_dir)
    return resolve_model_folder(choice.pretrained_path, key=key)


def _causal(config, meta, checked: CheckedModel):
    """The folder's model as a causal LM: the config flags without which its class attends to
    later tokens turned on (a note), and the meta model built again if any was."""
    if not (flags := causal_flags(config, meta)):
        return meta
    said = ", ".join(f"{flag}=true" for flag in flags)
    checked.notes.append(
        f"note: model type '{config.model_type}' attends to later tokens unless its config sets "
        f"{said} ({checked.path / 'config.json'} does not): trained with {said}, as a causal LM "
        "must be; the export's config.json says so"
    )
    return meta_causal_lm(config)


def config_problems(config, path: Path | None, seq_len: int) -> list[Problem]:
    """What the model's config cannot run: ``seq_len`` beyond its positions, more experts per
    token than it has, and its model type's own rules (the families' table). ``path``: the folder
    whose ``config.json`` it is (None: ``model.config``)."""
    found = []
    positions = getattr(config.get_text_config(), "max_position_embeddings", None)  # composite's
    if positions is not None and seq_len > positions:
        message = (
            f"train.seq_len ({seq_len}) exceeds the model's max_position_embeddings "
            f"(model.config.max_position_embeddings={positions}): use train.seq_len={positions} "
            "or less" + ("" if path else ", or raise model.config.max_position_embeddings")
        )
        found.append(Problem(key="train.seq_len", message=message))
    if path is None:
        return found + problems("model.config", routing_errors(config))
    where = path / "config.json"
    found += problems("model", config_rule_errors(config, where))
    return found + problems("model", [f"{where}: {e}" for e in routing_errors(config, "")])


def lora_problems(
    meta, lora: LoraTargets, experts: tuple[str, ...], model_name: str
) -> list[Problem]:
    """Why ``lora`` cannot adapt the meta model, whose expert modules ``experts`` names (none
    when it can); it is converted in place on success."""
    targeted, found = targeted_linears(meta, lora.target_modules)
    found = problems("peft.target_modules", found)
    found += problems("peft.merge", _tied_head_merge_errors(meta, targeted) if lora.merged else [])
    if lora.experts and not experts:
        message = (
            f"peft.experts=true needs an MoE model: model={model_name} has no experts "
            "(model.experts names none); use peft.experts=false"
        )
        found.append(Problem(key="peft.experts", message=message))
    elif lora.experts:
        found += problems("peft.experts", targeted_experts(meta, experts)[1])
    if not found:
        adapted = tuple(experts) if lora.experts else ()
        patterns = lora.target_modules
        options = LoraOptions(
            rank=1, alpha=1.0, dropout=0.0, target_modules=patterns, experts=adapted
        )
        apply_lora(meta, options, seed=0)
    return found


def _tied_head_merge_errors(meta, targeted: list[str]) -> list[str]:
    """An adapter on a head the model ties to its input embeddings, merged: the one weight would
    take the head's update in the embeddings too, which the trained model left alone."""
    if not getattr(meta.config, "tie_word_embeddings", False):
        return []
    head = meta.get_output_embeddings()
    name = next((name for name, module in meta.named_modules() if module is head), None)
    if name not in targeted:
        return []
    return [
        f"peft.merge=true with an adapter on {name}, which this model ties to its input "
        "embeddings (tie_word_embeddings): merged, the one weight would change the embeddings "
        "too: use peft.merge=false (adapter/ alone is the trained model), or leave "
        f"{name} out of peft.target_modules"
    ]


def _layout_problems(
    config, meta, use: ModelUse, dims: ParallelDims, moe: tuple[tuple, tuple]
) -> list[Problem]:
    """What this model cannot take at ``dims``: the TP plan and the sizes tp must divide, a
    pipeline stage's structure, fp8's layers, compile (cp's: :func:`cp_problems`). ``moe``: its
    expert and router patterns."""
    experts, _ = moe
    found = tp_structure_problems(config, meta, use, dims, moe) + tp_problems(config, dims.tp)
    found += stage_problems(config, meta, dims.pp)
    try:
        check_compile(use.compile, use.device_type, bool(experts), dims.ep)
    except ValueError as error:
        found.append(Problem(key="train.compile", message=str(error)))
    return found


def tp_structure_problems(
    config, meta, use: ModelUse, dims: ParallelDims, moe: tuple[tuple, tuple]
) -> list[Problem]:
    """What the meta model's structure refuses at ``dims.tp``: its TP plan, with ``peft=qlora``
    the NF4 tiles of the adapters' bases (then split over FSDP's shards), with fp8 the float8
    layers' matmul shapes per rank."""
    experts, _ = moe
    tp = dims.tp
    styles, found = checked_plan(config, meta, tp, use.sequence_parallel, moe)
    if use.nf4_base and use.lora is not None:  # the adapters were placed: their bases' tiles
        found += problems("peft", nf4_problems(meta, styles, tp, dims.fsdp_shards))
    if use.precision == "fp8":
        found += _fp8_problems(meta, use, tp, bool(experts), styles)
    return found


def other_layout_refusals(
    choice: ModelChoice, config, meta, use: ModelUse, dims: ParallelDims, moe: tuple[tuple, tuple]
) -> dict[tuple[str, int], tuple[str, ...]]:
    """``ModelFacts.refusals``: at each of ``use.other_layouts`` (a degree and its size, on the
    world of ``dims``, dp taking up the rest as the dry run's change does), the lines the model's
    checks of that degree refuse it with (none: that size is not here; fewer HSDP replicas move
    FSDP's shards, which NF4 tiles must divide); a tp the sizes refuse is the layout's rule, and
    skipped."""
    found = {}
    for name, size in use.other_layouts:
        if name in ("tp", "dp_replicate"):  # the TP plan; FSDP's shards of the NF4 tiles
            try:
                at = dims.changed(**{name: size})
            except LayoutError:  # not a layout of this world: the dry run never tries it
                continue
            sized = bool(tp_problems(config, at.tp))  # the layout's own rule refuses it
            refused = [] if sized else tp_structure_problems(config, meta, use, at, moe)
        elif name == "cp":
            refused = cp_problems(choice, use, size, config)
        else:
            refused = stage_problems(config, meta, size)
        found |= {(name, size): tuple(p.message for p in refused)} if refused else {}
    return found


def with_frozen_model_refusals(
    facts: ModelFacts | None, frozen: CheckedModel, name: str, dims: ParallelDims
) -> ModelFacts | None:
    """``facts`` of the trained model with what a frozen model run beside it on the same layout
    (DPO's reference, distillation's teacher: ``name``, checked with the dry run's other layouts)
    refuses at each degree a dry run may suggest: its checks' refusals and its sizes' tp rule,
    each line marked ``name``'s, so that the dry run suggests no layout the frozen model cannot
    take (None: the trained model's checks did not finish, nothing to add to)."""
    if facts is None:
        return None
    found = {key: list(lines) for key, lines in facts.refusals.items()}
    for key, lines in frozen.refusals.items():
        found.setdefault(key, []).extend(f"{name}: {line}" for line in lines)
    for size in dims.larger("tp"):
        sized = tp_problems(frozen.config, size)
        found.setdefault(("tp", size), []).extend(f"{name}: {p.message}" for p in sized)
    return replace(facts, refusals={key: tuple(lines) for key, lines in found.items() if lines})


def cp_problems(choice: ModelChoice, use: ModelUse, cp: int, config) -> list[Problem]:
    """What this model cannot take at ``cp``: the attention kernel, a model type that numbers
    its own positions or shards no sequence, attention outside the interface."""
    found = kernel_problems(choice, use, cp, config)
    found += problems("cp", sequence_problems(config, cp, packing=False))
    return found + problems("cp", attention_problems(config, cp))


def stage_problems(config, meta, pp: int) -> list[Problem]:
    """With pp > 1, what in the meta model's structure a pipeline stage cannot hold yet, or a
    config that names no one stack of decoder layers to cut into stages (BLT's)."""
    if pp == 1:
        return []
    why = stage_structure_problem(meta) if meta is not None else None
    if getattr(config.get_text_config(), "num_hidden_layers", None) is None:
        why = why or "its config names no num_hidden_layers"
    if not why:
        return []
    message = f"pp={pp} with model type '{config.model_type}' is not supported yet ({why})"
    return [Problem(key="pp", message=f"{message}: use pp=1")]


def checked_plan(
    config, meta, tp: int, sequence_parallel: bool, moe: tuple[tuple, tuple]
) -> tuple[dict, list[Problem]]:
    """The TP plan at ``tp`` checked on the meta model (``moe``: the expert and router patterns
    it leaves to expert parallelism): (the style each module gets, its problems); ({}, []) at
    tp=1."""
    if tp == 1:
        return {}, []
    experts, routers = moe
    try:
        plan = plan_for(config, sequence_parallel, meta)
        styles, errors = check_plan(meta, config, plan, tp, (*experts, *routers), sizes=False)
    except ValueError as error:  # no plan, given or derived
        return {}, [Problem(key="model", message=str(error))]
    return styles, problems("model", errors)


def tp_problems(config, tp: int) -> list[Problem]:
    """The model sizes ``tp`` must divide, and with any refused the tp values that fit: the
    layout's rule (``components/distributed/layout.py``) on the sizes of ``config``."""
    return tp_size_problems(tp_sizes(config), tp)


def _fp8_problems(meta, use: ModelUse, tp: int, moe: bool, styles: dict) -> list:
    """``train.precision=fp8``: what the float8 linears cannot take here (an MoE model, LoRA, the
    GPU), else each converted layer's matmul dimensions at this tp (with the TP plan's
    ``styles``); the tokens per cp rank are the layout's rule (``ParallelDims.problems``)."""
    if found := fp8_problems(meta, moe, use.peft_lora, use.device_type):
        return problems("train.precision", found)
    return problems("train.precision", fp8_shape_errors(meta, tp, styles))


def _unbuildable(config, error: Exception) -> Problem:
    """transformers' own model class fails on this config (DBRX's attention config lacks the
    ``rope_theta`` its model reads in transformers 5.23): that version's gap, not the folder's."""
    said = f"{type(error).__name__}: {error}".splitlines()[0]
    return Problem(
        key="model",
        message=f"model type '{config.model_type}' is not supported with transformers "
        f"{transformers.__version__}: its model class cannot be built from this config ({said})",
    )


def check_teacher(
    choice: ModelChoice,
    use: ModelUse,
    dims: ParallelDims | None,
    student: CheckedModel,
    student_vocab: int | None,
) -> CheckedModel:
    """A distillation teacher (``choice``: the ``teacher`` group, its family already resolved)
    checked as a model of its own for ``use`` at ``dims`` (its folder or config, its TP plan),
    then its vocabulary against the ``student``'s (a student built from its config: of
    ``model.config.vocab_size``, ``student_vocab``; None: the tokenizer's); every problem and
    note named ``teacher.*``."""
    checked = check_model(choice, use, dims)
    checked.problems = [as_teacher(problem) for problem in checked.problems]
    checked.notes = [_teacher_keys(note) for note in checked.notes]
    if checked.config is not None and student.config is not None:
        vocabularies = (student_vocab, choice.config.get("vocab_size"))
        checked.problems += vocabulary_problems(student, checked, *vocabularies)
    return checked


# The model group's keys a teacher's problem names as the teacher group's.
TEACHER_KEYS = {
    "model.config": "teacher.config",
    "model.pretrained_path": "teacher.pretrained_path",
    "model.family": "teacher.family",
    "model=teacher": "the teacher",
}


def as_teacher(problem: Problem) -> Problem:
    """A model check's problem said of the teacher: its key and the ``model.*`` keys it names
    (:data:`TEACHER_KEYS`) the ``teacher`` group's, the line marked as the teacher's."""
    key = (
        problem.key.replace("model", "teacher", 1)
        if problem.key.startswith("model")
        else problem.key
    )
    message = _teacher_keys(problem.message)
    return Problem(
        key=key, message=message if message.startswith("teacher") else f"teacher: {message}"
    )


def _teacher_keys(line: str) -> str:
    """``line`` with the ``model`` group's keys named as the ``teacher`` group's."""
    for model_key, teacher_key in TEACHER_KEYS.items():
        line = line.replace(model_key, teacher_key)
    return line


def vocabulary_problems(
    student: CheckedModel,
    teacher: CheckedModel,
    student_vocab: int | None,
    teacher_vocab: int | None,
) -> list[Problem]:
    """The teacher's vocabulary must be the student's, token for token (the KL compares their
    distributions over it): a folder's tokenizer against the student's folder's, a built
    teacher's ``vocab_size`` (``teacher_vocab``; None: the student's) against the student's (its
    folder's, or a built student's ``student_vocab``; None: its tokenizer's)."""
    if teacher.path is not None and student.path is None:
        return [
            Problem(
                key="teacher.pretrained_path",
                message=f"teacher.pretrained_path={teacher.path} with a student built from "
                "model.config is not supported: the student's tokenizer is trained on the data "
                "only in preparation, so the teacher's vocabulary cannot be checked against it "
                "before the run; give the student a folder of the teacher's tokenizer "
                "(model=pretrained model.pretrained_path=...) or build the teacher from "
                "teacher.config (teacher.pretrained_path=null)",
            )
        ]
    if teacher.path is not None:
        return _folder_vocabulary_problems(student, teacher)
    if teacher_vocab is None:
        return []
    sizes = student.config.vocab_size if student.path is not None else student_vocab
    if teacher_vocab == sizes:
        return []
    student_size = "the tokenizer's, sized in preparation" if sizes is None else str(sizes)
    message = (
        f"teacher.config.vocab_size={teacher_vocab} must be the student's vocabulary "
        f"({student_size}): use teacher.config.vocab_size=null (the student's)"
    )
    return [Problem(key="teacher.config.vocab_size", message=message)]


def vocabulary_difference(first: CheckedModel, second: CheckedModel) -> str | None:
    """What differs between two folders' vocabularies: ``sizes`` (their configs' vocab_size),
    ``tokens`` (their tokenizers' token of some id), or None: nothing."""
    if first.config.vocab_size != second.config.vocab_size:
        return "sizes"
    first_tokens, second_tokens = (_tokens(model.path) for model in (first, second))
    return None if first_tokens == second_tokens else "tokens"


def _tokens(folder: Path) -> dict[str, int]:
    """The folder's tokenizer's vocabulary: each token's id."""
    return transformers.AutoTokenizer.from_pretrained(
        str(folder), trust_remote_code=False
    ).get_vocab()


def _folder_vocabulary_problems(student: CheckedModel, teacher: CheckedModel) -> list[Problem]:
    """Two folders: the same vocabulary size, the same token of every id."""
    sizes = (student.config.vocab_size, teacher.config.vocab_size)
    which = vocabulary_difference(student, teacher)
    if which is None:
        return []
    vocabularies = [_tokens(model.path) for model in (student, teacher)]
    message = (
        f"the teacher's vocabulary ({teacher.path}: {sizes[1]} rows, {len(vocabularies[1])} "
        f"tokens) differs from the student's ({student.path}: {sizes[0]} rows, "
        f"{len(vocabularies[0])} tokens) in its {which}: distillation compares the two models "
        "token by token; use a teacher of the student's tokenizer"
    )
    return [Problem(key="teacher.pretrained_path", message=message)]
