"""Tiny random models of every causal-LM model type of the pinned transformers, built from each
type's own config class shrunk to a few kilobytes of weights, written by ``save_pretrained``, and
the recipe run on them through the command line at a few layouts, each result classified as
works / refused (one ``error:`` line) / broken. ``bench/coverage.py`` sweeps every type with these;
``tests/e2e/test_coverage.py`` runs a few; ``tests/coverage_page.py`` writes and reads the page.
"""

import datetime
import json
import math
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from components.models.load import causal_flags
from tests.saved_models import BATCH, MICRO, SEQ_LEN, first_batch, recipe

VOCAB = 384  # components.data.DEFAULT_VOCAB_SIZE: the tokenizer the runs train, even for tp=2
HIDDEN = ("hidden_size", "n_embd", "d_model", "dim", "embed_dim")
HIDDEN += ("adapter_in_dim", "adapter_input_size")  # dots3_note's adapter
HIDDEN += ("hidden_size_global",)  # BLT's byte encoder and decoder meet its global model
LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
# BART and its kin: their configs map num_hidden_layers to encoder_layers, and the causal LM runs
# the decoder (Blenderbot's default: 24 layers, feed-forward 10240 wide)
DECODER_LAYERS = ("decoder_layers",)
# Common config attribute names and the tiny value each takes (only where the type has the name).
SHRINK = {
    **dict.fromkeys((*LAYER_COUNTS, *DECODER_LAYERS), 2),
    **dict.fromkeys(("num_dense_layers", "first_k_dense_replace"), 1),  # one dense, one MoE
    "num_kv_shared_layers": 0,
    "zero_expert_num": 2,  # LongCat's identity experts: 6 in all, so ep=2 divides them
    **dict.fromkeys(HIDDEN, 64),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size"), 128),
    **dict.fromkeys(("decoder_ffn_dim", "encoder_ffn_dim"), 128),
    **dict.fromkeys(("num_attention_heads", "n_head", "num_heads", "n_heads"), 4),
    **dict.fromkeys(("encoder_attention_heads", "decoder_attention_heads"), 4),
    **dict.fromkeys(("num_key_value_heads", "n_kv_heads", "num_kv_heads"), 2),
    **dict.fromkeys(("head_dim", "kv_channels", "attention_head_dim"), 16),
    "rotary_dim": 16,  # CodeGen's and GPT-J's rotary part of each 16-wide head
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "seq_length"), 128),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "top_k", "moe_k"), 2),
    **dict.fromkeys(("moe_intermediate_size", "expert_intermediate_size"), 32),
    **dict.fromkeys(("shared_expert_intermediate_size",), 64),
    **dict.fromkeys(("n_shared_experts", "num_shared_experts"), 1),
    **dict.fromkeys(("expert_ffn_hidden_size", "ffn_hidden_size_per_expert"), 32),
    # multi-head latent attention (DeepSeek and its kin) and its sparse indexer
    **dict(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16),
    **dict(n_group=2, topk_group=1),  # expert groups for group-limited routing
    **dict(index_topk=16, index_head_dim=16, index_n_heads=2),
    **dict(vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16),
    "vocab_size": VOCAB,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
}
# What the generic names cannot know, per model type.
ROPE = {"rope_type": "default", "rope_theta": 10000.0}
OVERRIDES: dict[str, dict] = {
    "cohere_compass_text": {"rope_parameters": {"full_attention": ROPE}},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    "blt": {"encoder_hash_byte_group_vocab": 512},
    "xmod": {"default_language": "en_XX"},
    "mamba2": {"head_dim": 32, "n_groups": 1},  # its 4 heads span hidden_size × expand (2)
    "zaya": {"num_experts_per_tok": 1},  # the only top-k it supports
}
OVERRIDES["qwen4_exp_text"] = OVERRIDES["qwen4_exp.text_config"] = {
    **dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=16),
    **dict(indexer_compress_ratio=4, ngram_vocab_size_base=256, hc_lowrank=16, ple_embed_dim=64),
    **dict(linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2),
    **dict(linear_num_value_heads=4, split_ngram_parts=4),
}
LORA = ["peft=lora", "peft.target_modules=LINEARS"]  # every linear's name (lora_targets)
LAYOUTS = {
    "tp1": ["tp=1"],
    "tp2": ["tp=2"],
    "tp2_sp": ["tp=2", "sp=true"],
    "tp2_ep2": ["tp=2", "ep=2"],
    # the layouts that can be silently wrong, each against its reference (REFERENCES)
    "pp2": ["pp=2"],
    "cp2": ["cp=2"],
    "lora_tp1": LORA,  # the LoRA column's reference, itself checked against tp=1 (first loss)
    "lora": [*LORA, "tp=2"],
    "fp8": ["train.precision=fp8"],
}
REFERENCES = {"lora": "lora_tp1"}  # a layout's reference run, when not tp=1
TOLERANCE = 1e-5  # relative, on every step's loss, against tp=1
# fp8 against fp32 at tp=1 (every step's loss, relative): the band docs/precision-and-memory.md
# gives fp8 against bf16-mixed over 30 steps
TOLERANCES = {"fp8": 2e-2}
# Types whose training forward draws random numbers that no config turns off, and why: they run
# every layout with packed rows, all train.seq_len long, so every layout draws on the same shapes
# (sequence parallelism pads a micro-batch to a multiple of 8 × tp, not 8, and the extra padding
# tokens would shift the draws: other samples, losses within the noise but not equal).
STOCHASTIC = {"phimoe": "its router samples experts in training (sparsemixer)"}
# Types whose forward keeps the top k of scores with exact ties at the cut, and where: which tied
# entry a top-k keeps depends on the order of floating-point sums, so the recipe's micro-batches
# (2 rows) and the model's own forward on the whole batch (4 rows) may keep different ones. Their
# tp=1 run is checked against the model's own loss with the whole batch in one micro-batch, as the
# model's own forward computes it (AXK2: 5.909504 both ways; 5.909374 in 2-row micro-batches).
TIES = {
    "axk2": "its sparse-attention indexer keeps each query's top 16 keys by ReLU'd scores, "
    "which tie at 0 at the cut in 48 of layer 0's 64 rows"
}
# Types whose runs take longer than a recipe run's usual 300 s, the time they get, and why.
MAMBA = "its Mamba layers run transformers' reference scan without mamba_ssm's kernels"
TIMEOUTS = dict.fromkeys(
    ("bamba", "falcon_h1", "falcon_mamba", "jamba", "mamba", "mamba2", "nemotron_h", "zamba",
     "zamba2", "granitemoehybrid"),
    (900, f"{MAMBA}: Bamba's fp8 run (its bf16 parts) took 140 s a step on this CPU under load"),
)  # fmt: skip
WHOLE_BATCH = [f"train.micro_batch_size={BATCH}"]  # one forward per step: the model's own batch


def causal_lm_types() -> list[str]:
    """Every model type ``AutoModelForCausalLM`` maps, sorted."""
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def has_plan(model_type: str) -> str:
    """``own`` where the type's config class ships a ``base_model_tp_plan``, ``text`` where only
    its text config's does (an image-text model), else empty."""
    config_class = CONFIG_MAPPING[model_type]
    if getattr(config_class, "base_model_tp_plan", None):
        return "own"
    text = getattr(config_class, "sub_configs", {}).get("text_config")
    return "text" if text and getattr(text, "base_model_tp_plan", None) else ""


def _shrunk(config_class, defaults: dict, model_type: str) -> dict:
    aliases = getattr(config_class, "attribute_map", {})  # e.g. num_experts_per_tok -> its name
    named = {aliases.get(key, key): value for key, value in SHRINK.items()}
    values = {key: value for key, value in named.items() if key in defaults}
    if defaults.get("q_lora_rank") is None:  # None: no query LoRA
        values.pop("q_lora_rank", None)
    if "head_dim" in values and defaults.get("head_dim") == defaults.get("qk_rope_head_dim"):
        values["head_dim"] = SHRINK["qk_rope_head_dim"]  # MLA: rotary over the rope part only
    heads = [defaults.get(key) for key in ("num_attention_heads", "num_key_value_heads")]
    if "num_key_value_heads" in values and heads[1] in (None, heads[0]):
        values["num_key_value_heads"] = SHRINK["num_attention_heads"]  # no grouped queries
    layers = next((defaults[key] for key in LAYER_COUNTS if key in defaults), None)
    for key, value in defaults.items():
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            values[key] = 0.0  # dropout off: tp=2 must give tp=1's losses exactly
        elif isinstance(value, list) and len(value) == layers and layers > 2:
            different = [item for item in value if item != value[0]]  # keep both kinds of layer
            values[key] = [value[0], (different or value[1:])[0]]
        elif isinstance(value, dict) and value and all(str(k).isdigit() for k in value):
            values[key] = {k: v for k, v in value.items() if int(k) < 2}  # per-layer settings
    return values | OVERRIDES.get(model_type, {})


def tiny_config(model_type: str) -> PretrainedConfig:
    """The type's own config class with its sizes shrunk (sub-configs likewise) and dropout off."""
    config_class = CONFIG_MAPPING[model_type]
    defaults = config_class().to_dict()
    values = _shrunk(config_class, defaults, model_type)
    for name, sub_class in getattr(config_class, "sub_configs", {}).items():
        if isinstance(defaults.get(name), dict):
            sub = _shrunk(sub_class, defaults[name], f"{model_type}.{name}")
            values[name] = defaults[name] | sub
    return config_class(**values)


def is_moe(model: nn.Module) -> bool:
    """Whether the model has experts (a module named ``experts``), not only a config that names
    an expert count."""
    return any(name.rpartition(".")[2] == "experts" for name, _ in model.named_modules())


def save_tiny_model(model_type: str, folder: Path, tokenizer) -> nn.Module:
    """A random tiny model of ``model_type`` (seed 0) and ``tokenizer``, saved in ``folder``."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


@dataclass
class Result:
    """One layout's outcome: ``works``, ``refused`` (its one ``error:`` line) or ``broken`` (the
    last line of a traceback, or the losses that differ from tp=1); ``losses`` when it ran."""

    status: str
    line: str = ""
    losses: list[float] | None = None


def lora_targets(model: nn.Module) -> str:
    """``peft.target_modules`` for every linear layer of ``model`` (``lm_head`` among them): each
    linear's name as a pattern (``*.q_proj``, ``lm_head``), once."""
    names = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    patterns = sorted(
        {name if "." not in name else f"*.{name.rpartition('.')[2]}" for name in names}
    )
    return "[" + ",".join(patterns) + "]"


def run_layout(
    folder: Path,
    cache: Path,
    output_dir: Path,
    layout: str,
    linears: str = "[]",
    extra: tuple[str, ...] = (),
) -> Result:
    """The recipe (a few steps of :data:`tests.saved_models.COMMON`) on ``folder`` at ``layout``
    (with packed rows for a :data:`STOCHASTIC` type, the folder's name; ``linears``: the
    :func:`lora_targets` of the LoRA layouts; ``extra``: more overrides)."""
    packed = ["train.packing=true"] if folder.name in STOCHASTIC else []
    overrides = [override.replace("LINEARS", linears) for override in LAYOUTS[layout]]
    overrides += [*packed, *extra]
    try:
        folders = {"model": folder, "cache": cache}
        timeout, _ = TIMEOUTS.get(folder.name, (300, ""))
        result = recipe(folders, "model", output_dir, *overrides, timeout=timeout)
    except subprocess.TimeoutExpired as timeout:
        return Result("broken", f"no result within {timeout.timeout:.0f} s")
    return classify(result.returncode, result.stderr, output_dir / "metrics.jsonl")


def classify(returncode: int, stderr: str, metrics: Path) -> Result:
    lines = stderr.strip().splitlines()
    if returncode == 0 and metrics.exists():
        losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
        if losses and all(math.isfinite(loss) for loss in losses):
            return Result("works", losses=losses)
        return Result("broken", f"losses {losses}", losses)
    errors = [line for line in lines if line.startswith("error: ")]
    if returncode != 0 and len(errors) == 1 and not any("Traceback" in ln for ln in lines):
        return Result("refused", errors[0])
    return Result("broken", lines[-1] if lines else f"exit status {returncode}, no output")


def compare(
    reference: Result, result: Result, tolerance: float = TOLERANCE, steps: int | None = None
) -> Result:
    """``result`` as a twin of the ``reference`` run (tp=1's): broken if its losses (the first
    ``steps``, None: all) differ beyond ``tolerance`` (relative)."""
    if result.status != "works" or reference.status != "works":
        return result
    theirs, ours = reference.losses[:steps], result.losses[:steps]
    pairs = list(zip(theirs, ours, strict=False))
    worst = max(abs(a - b) / max(abs(a), 1e-12) for a, b in pairs)
    if len(theirs) != len(ours) or worst > tolerance:
        return Result("broken", f"losses differ from tp=1 by {worst:.2e}", result.losses)
    return Result("works", f"within {worst:.1e} of tp=1", result.losses)


def own_first_loss(folder: Path, cache: Path) -> float:
    """The causal-LM loss of the Hugging Face model's own logits on the recipe's first batch (the
    mean over labelled tokens, each position predicting the next), built from ``folder`` as the
    recipe builds it (with the flags that make it causal, ``causal_flags``). Not the model's
    ``labels=`` loss: BART's and BigBird-Pegasus's read the labels as already shifted."""
    config = AutoConfig.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if causal_flags(config, model):
        model = AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=torch.float32)
    inputs = first_batch(folder, cache, SEQ_LEN, BATCH, MICRO)
    with torch.no_grad():  # no cache, as in training (BART's decoder alone fails with one)
        logits = model(input_ids=inputs["input_ids"], use_cache=False).logits.float()
    predicted, targets = logits[:, :-1].flatten(0, 1), inputs["labels"][:, 1:].flatten()
    return F.cross_entropy(predicted, targets, ignore_index=-100).item()


def checked_against_own(result: Result, folder: Path, cache: Path, output_dir: Path) -> Result:
    """tp=1's ``result`` on ``folder``, broken if its first loss is not the Hugging Face model's
    own within :data:`TOLERANCE` (types whose training forward samples are run packed: not
    checked; a :data:`TIES` type's first loss is that of a run into ``output_dir`` with the whole
    batch in one micro-batch)."""
    if result.status != "works" or folder.name in STOCHASTIC:
        return result
    first = result.losses[0]
    if folder.name in TIES:
        whole = run_layout(folder, cache, output_dir, "tp1", extra=tuple(WHOLE_BATCH))
        if whole.status != "works":
            return whole
        first = whole.losses[0]
    try:
        own = own_first_loss(folder, cache)
    except Exception as error:  # noqa: BLE001 - the table records why there is no reference
        return Result("broken", f"the model's own loss failed: {type(error).__name__}: {error}")
    if abs(first - own) > TOLERANCE * abs(own):
        line = f"first loss {first:.6f}, the Hugging Face model's own {own:.6f}"
        return Result("broken", line, result.losses)
    return result


def judged(layout: str, results: dict[str, Result], result: Result) -> Result:
    """``result`` of ``layout`` against its reference among ``results``: LoRA at tp=1 starts from
    the base model (every B is zero), so its first loss is tp=1's; the LoRA column is LoRA at tp=2
    against LoRA at tp=1; fp8 within its band of tp=1; any other layout tp=1's twin."""
    if layout == "tp1":
        return result
    if layout == "lora_tp1":
        return compare(results["tp1"], result, steps=1)
    reference = results[REFERENCES.get(layout, "tp1")]
    return compare(reference, result, TOLERANCES.get(layout, TOLERANCE))


def as_json(results: dict[str, Result]) -> dict:
    return {layout: asdict(result) for layout, result in results.items()}


def from_json(data: dict) -> dict[str, Result]:
    return {layout: Result(**fields) for layout, fields in data.items()}


def _run(folder: Path, root: Path, layout: str, linears: str) -> Result:
    """The recipe on ``folder`` at ``layout``, into a fresh folder under ``root``."""
    output_dir = root / "runs" / folder.name / layout
    shutil.rmtree(output_dir, ignore_errors=True)
    return run_layout(folder, root / "cache", output_dir, layout, linears)


def sweep_type(
    model_type: str, root: Path, tokenizer, layouts=tuple(LAYOUTS), known: dict | None = None
) -> dict:
    """Build ``model_type``'s tiny model under ``root`` and run the ``layouts`` that apply to it
    (tp=2 ep=2 to MoE models; tp=1 and each layout's reference run first when not among
    ``layouts``); a layout whose reference does not work is its own refusal, LoRA tp=1's refusal
    (the LoRA column), or skipped; a JSON-ready entry of the table, merged into ``known`` (an
    earlier entry of the type), each layout's time of measurement in ``measured``."""
    entry = {"type": model_type, "plan": has_plan(model_type), "moe": False, "built": ""}
    folder = root / "models" / model_type
    shutil.rmtree(folder, ignore_errors=True)
    try:
        model = save_tiny_model(model_type, folder, tokenizer)
    except Exception as error:  # noqa: BLE001 - the table records why a type has no tiny model
        said = [line for line in str(error).splitlines() if line.strip()] or [""]
        entry["built"] = f"{type(error).__name__}: {said[0].strip()}"
        return entry | {"results": {}}
    entry["moe"], linears = is_moe(model), lora_targets(model)
    known = known or {}
    results, measured = from_json(known.get("results", {})), dict(known.get("measured", {}))
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    needed = {"tp1", *(REFERENCES.get(layout, "tp1") for layout in layouts), *layouts}
    for layout in [name for name in LAYOUTS if name in needed]:  # references first
        if layout == "tp2_ep2" and not entry["moe"]:
            continue
        name = REFERENCES.get(layout, "tp1")
        reference = results.get(name)
        if layout != "tp1" and reference.status != "works":
            if layout in REFERENCES and reference.status != "skipped":
                results[layout], measured[layout] = reference, measured[name]  # why LoRA fails
                continue
            result = _run(folder, root, layout, linears)  # a refusal is a cell of its own
            if result.status != "refused":  # nothing to compare it with
                results[layout] = Result("skipped", f"{name} does not work")
                continue
        else:
            result = _run(folder, root, layout, linears)
            if layout == "tp1":
                whole = root / "runs" / model_type / "tp1_whole_batch"
                result = checked_against_own(result, folder, root / "cache", whole)
            result = judged(layout, results, result)
        results[layout], measured[layout] = result, now
    shutil.rmtree(root / "runs" / model_type, ignore_errors=True)
    return entry | {"results": as_json(results), "measured": measured}
