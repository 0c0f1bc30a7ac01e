"""``recipes/dpo.py`` through the command line, on the embedded preference pairs and the tiny
Llama: tp=2, tp=2 with sp and dp=2 × tp=2 equal the tp=1 run step by step within 1e-5 (loss, grad
norm and every DPO metric), with AdamW and with SGD, and with ``peft=lora`` (the reference: the
policy's adapters off); the run trains (its reward margins grow), writes DPO's metrics and exports
the policy; what DPO refuses is one ``error:`` line before any rank starts; a reference folder
(``dpo.reference_path``) other than the policy's start gives the first step's rewards and loss a
plain computation gives from that folder's own log-probabilities, at tp=2. make test runs the
SGD (ipo, full fine-tuning, exported) and the AdamW (LoRA, tp=2 sp) twins; tp=2 and the 4-rank
dp=2 × tp=2 sp AdamW twins run under ``-m sweep`` only. Those runs do not validate
(train.val_every=0); the validation on held-out pairs is equal at dp=2 over an odd number of pairs
and at tp=2 (full with AdamW, LoRA with SGD), and is what a training step of the validated policy
computes on the same pair."""

import math
import os
import sys
from pathlib import Path

import datasets
import pytest
from transformers import AutoModelForCausalLM

from components.training.preference import DPO_METRICS
from tests import cli
from tests.e2e.test_recipe_training import REPO, metrics
from tests.saved_models import reference_folders
from tests.selection import selected_params
from tests.unit.recipes.test_dpo_data import IMPLICIT, MULTI_TURN, write_jsonl

COMMON = [
    "train.max_steps=4",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
    "data.num_examples=64",
    "train.val_every=0",
    "checkpoint.export=false",
]
SGD = ["optim=sgd", "optim.lr=0.05"]
LORA = ["peft=lora", "peft.rank=4", "peft.alpha=8.0", "optim.lr=1e-2"]
LORA += ["peft.target_modules=[lm_head,*_proj]"]  # the head's adapter too, split over the vocab
RUNS = {
    "tp1": [],
    "tp2": ["tp=2"],
    "dp2_tp2_sp": ["tp=2", "dp=2", "sp=true"],
    "ipo_sgd_tp1": [*SGD, "dpo.loss_type=ipo", "dpo.beta=0.5"],
    "ipo_sgd_tp2": [*SGD, "dpo.loss_type=ipo", "dpo.beta=0.5", "tp=2", "checkpoint.export=true"],
    "lora_tp1": LORA,
    "lora_tp2_sp": [*LORA, "tp=2", "sp=true"],
}
TWINS = {"tp2": "tp1", "dp2_tp2_sp": "tp1", "ipo_sgd_tp2": "ipo_sgd_tp1", "lora_tp2_sp": "lora_tp1"}
SWEEP = {"tp2", "dp2_tp2_sp"}  # AdamW as lora_tp2_sp, full fine-tuning at tp=2 as ipo_sgd_tp2


def dpo(output_dir: Path, *overrides: str, status: int = 0):
    command = [sys.executable, "recipes/dpo.py", *COMMON, f"output_dir={output_dir}", *overrides]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = cli.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=300, env=environment
    )
    assert result.returncode == status, f"{' '.join(command)}\n{result.stderr[-4000:]}"
    return result


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dpo")
    skipped = SWEEP - set(selected_params(request, "name"))
    names = [name for name in RUNS if name not in skipped]
    for name in names:
        dpo(root / name, *RUNS[name])
    return {name: root / name for name in names}


@pytest.mark.parametrize(
    "name",
    [
        "ipo_sgd_tp2",
        "lora_tp2_sp",
        pytest.param("tp2", marks=pytest.mark.sweep),
        pytest.param("dp2_tp2_sp", marks=pytest.mark.sweep),
    ],
)
def test_each_layout_equals_its_tp1_twin_step_by_step(runs, name):
    """The loss, grad norm and log-probabilities within 1e-5 relative; the rewards, β × differences
    of log-probabilities of about -20 that nearly cancel, within 1e-5 of those log-probabilities."""
    reference = metrics(runs[TWINS[name]])
    for ours, theirs in zip(metrics(runs[name]), reference, strict=True):
        scale = abs(theirs["logps/chosen"]) + abs(theirs["logps/rejected"])
        for key in (*DPO_METRICS, "grad_norm"):
            within = dict(abs=1e-5 * scale) if key.startswith("rewards/") else dict(rel=1e-5)
            assert ours[key] == pytest.approx(theirs[key], **within), key


def test_dpo_trains_and_exports_the_policy(runs):
    steps = metrics(runs["tp1"])
    assert [step["step"] for step in steps] == [1, 2, 3, 4]
    assert steps[0]["loss"] == pytest.approx(0.6931471805599453, rel=1e-6)  # policy = reference
    assert steps[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-9)
    assert steps[-1]["rewards/margins"] > 0 and steps[-1]["loss"] < steps[0]["loss"]
    for step in steps:
        assert step["rewards/margins"] == pytest.approx(
            step["rewards/chosen"] - step["rewards/rejected"], abs=1e-6
        )
        assert 0 <= step["rewards/accuracies"] <= 1 and step["logps/chosen"] < 0
    model = AutoModelForCausalLM.from_pretrained(runs["ipo_sgd_tp2"] / "hf")
    assert model.config.model_type == "llama"
    card = (runs["ipo_sgd_tp2"] / "hf" / "README.md").read_text()
    assert "recipes/dpo.py" in card and "recipes/finetune.py" not in card  # the model card


def test_what_dpo_does_not_run_is_one_error_line_before_any_rank(tmp_path):
    bad = tmp_path / "pairs.jsonl"
    bad.write_text(
        '{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "a", "chosen": "b"}\n'
    )
    refused = ["cp=2", "train.packing=true", "dpo.loss_type=ipo", "dpo.label_smoothing=0.1"]
    lines = dpo(tmp_path / "run", *refused, status=2).stderr.strip().splitlines()
    assert lines == [
        "error: dpo.label_smoothing=0.1 applies to dpo.loss_type=sigmoid only: use "
        "dpo.label_smoothing=0.0 with ipo; cp=2 is not run by dpo.py: an answer's "
        "log-probability sums its whole sequence, which context parallelism splits: use cp=1; "
        "train.packing=true is not run by dpo.py: a preference pair's two conversations are rows "
        "of their own: use train.packing=false"
    ]
    data = ["data=jsonl", f"data.path={bad}"]
    lines = dpo(tmp_path / "run", *data, status=2).stderr.strip().splitlines()
    assert lines == [
        f'error: data: {bad} line 2: a preference record needs "chosen" and "rejected" (missing '
        "rejected; its keys: 'chosen', 'prompt')"
    ]
    mix = ["data=mix", "data.sources=[{name:a,weight:1,kind:generated}]"]
    lines = dpo(tmp_path / "run", *mix, status=2).stderr.strip().splitlines()
    assert lines == [
        "error: data=mix mixes prompt and answer records: preference pairs are not mixed yet"
    ]
    assert not (tmp_path / "run").exists()  # refused before the folder is claimed


def test_resume_at_another_tp_equals_the_uninterrupted_run(runs, tmp_path):
    """Stopped after step 2 at tp=2 (a checkpoint of the policy and its optimizer; the reference
    is rebuilt from the starting weights), resumed at tp=1: steps 3 and 4 are the uninterrupted
    run's."""
    interrupted = tmp_path / "interrupted"
    dpo(interrupted, "tp=2", "checkpoint.every_steps=2", "train.stop_after=2")
    dpo(interrupted, "checkpoint.resume=auto")
    resumed, uninterrupted = metrics(interrupted), metrics(runs["tp1"])
    assert [step["step"] for step in resumed] == [1, 2, 3, 4]
    for ours, theirs in zip(resumed[2:], uninterrupted[2:], strict=True):
        for key in ("loss", "logps/chosen", "logps/rejected", "grad_norm"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-5), key


PATHS = (("model.pretrained_path", "policy"), ("dpo.reference_path", "reference"))


def test_a_reference_folder_gives_the_first_step_of_a_plain_computation_at_tp2(tmp_path):
    """One pair, one step: the policy (a folder) against ``dpo.reference_path`` (a folder of its
    shape and tokenizer, other weights) at tp=2; that folder's own answer log-probabilities come
    from a tp=1 run with it as the policy (its own reference: loss log 2). The rewards are β × the
    differences and the loss −log σ(β·Δ), as TRL's ``DPOTrainer(ref_model=...)`` computes them."""
    folders = reference_folders(tmp_path / "models")
    one_pair = ["model=pretrained", "train.max_steps=1", "train.global_batch_size=1"]
    one_pair += ["train.micro_batch_size=1", "train.warmup_steps=0", "dpo.beta=1.0"]
    reference = f"dpo.reference_path={folders['reference']}"
    dpo(
        tmp_path / "tp2", *one_pair, f"model.pretrained_path={folders['policy']}", reference, "tp=2"
    )
    dpo(tmp_path / "own", *one_pair, f"model.pretrained_path={folders['reference']}")
    [ours], [its_own] = metrics(tmp_path / "tp2"), metrics(tmp_path / "own")
    chosen = ours["logps/chosen"] - its_own["logps/chosen"]  # β = 1
    rejected = ours["logps/rejected"] - its_own["logps/rejected"]
    scale = abs(ours["logps/chosen"]) + abs(ours["logps/rejected"])
    assert ours["rewards/chosen"] == pytest.approx(chosen, abs=1e-5 * scale)
    assert ours["rewards/rejected"] == pytest.approx(rejected, abs=1e-5 * scale)
    plain = -math.log(1 / (1 + math.exp(-(chosen - rejected))))  # −log σ(β·Δ)
    assert ours["loss"] == pytest.approx(plain, rel=1e-5)
    assert abs(ours["loss"] - math.log(2)) > 1e-3  # not the policy's own start as reference


def test_multi_turn_pairs_from_jsonl_and_parquet_train_alike_on_their_answers(tmp_path):
    """The trial's multi-turn pairs: as {"prompt": [messages], ...} lines through data=jsonl
    (whose group labels every assistant turn for finetune.py), and as whole conversations
    (TRL's implicit prompt) in a parquet file through data=hf with the earlier turns' labels
    off (data.loss_on=last_assistant): the same log-probabilities, rewards, losses and grad
    norms at every step, within 1e-6."""
    jsonl = write_jsonl(tmp_path / "pairs.jsonl", MULTI_TURN)
    parquet = tmp_path / "pairs.parquet"
    implicit = write_jsonl(tmp_path / "implicit.jsonl", IMPLICIT)
    datasets.load_dataset("json", data_files=str(implicit), split="train").to_parquet(parquet)
    steps = ["train.max_steps=2", "train.global_batch_size=2", "data.val_fraction=0"]
    dpo(tmp_path / "jsonl", *steps, "data=jsonl", f"data.path={jsonl}")
    hf = ["data=hf", f"data.path={parquet}", "data.loss_on=last_assistant"]
    dpo(tmp_path / "hf", *steps, *hf)
    ours, theirs = metrics(tmp_path / "jsonl"), metrics(tmp_path / "hf")
    assert len(ours) == 2
    for one, other in zip(ours, theirs, strict=True):
        for key in (*DPO_METRICS, "grad_norm", "tokens"):
            assert one[key] == pytest.approx(other[key], rel=1e-6, abs=1e-9), key
    assert ours[1]["loss"] != pytest.approx(math.log(2), abs=1e-6)  # step 2 has trained


# Five held-out pairs (odd: dp=2's shorter share ends in a padding pair), validated after step 2.
VALIDATED = ["train.max_steps=2", "data.num_examples=50", "data.val_fraction=0.1"]
VALIDATED += ["train.val_every=2"]
VAL_TWINS = {  # a layout -> its tp=1 twin
    "dp2": (["dp=2"], []),
    "lora_sgd_tp2": ([*LORA, *SGD, "optim.lr=2.0", "tp=2"], [*LORA, *SGD, "optim.lr=2.0"]),
}
VAL_METRICS = [f"val_{name}" for name in DPO_METRICS]


@pytest.mark.parametrize("name", list(VAL_TWINS))
def test_validation_on_held_out_pairs_equals_its_tp1_twin(tmp_path, name):
    """Every ``val_`` metric (the loss, rewards, accuracy and log-probabilities over the five
    held-out pairs) within 1e-6 of the tp=1 twin's (rewards: of the log-probabilities' scale):
    dp=2's padding pair counts nothing."""
    layout, twin = VAL_TWINS[name]
    dpo(tmp_path / "ours", *VALIDATED, *layout)
    dpo(tmp_path / "twin", *VALIDATED, *twin)
    [_, ours], [_, theirs] = metrics(tmp_path / "ours"), metrics(tmp_path / "twin")
    assert "val_loss" in ours and ours["val_loss"] != pytest.approx(math.log(2), abs=1e-4)
    scale = abs(theirs["val_logps/chosen"]) + abs(theirs["val_logps/rejected"])
    for key in VAL_METRICS:
        within = dict(abs=1e-6 * scale) if key.startswith("val_rewards/") else dict(rel=1e-6)
        assert ours[key] == pytest.approx(theirs[key], **within), key


def test_validation_is_a_training_step_of_the_validated_policy(tmp_path):
    """Every pair the same, so the held-out ones are too: the validation after step 1 (of the
    policy then exported) equals the first step's metrics of a run that starts from that export
    against the starting weights as ``dpo.reference_path`` (the training step TRL's trainer
    checks), within 1e-5."""
    folders = reference_folders(tmp_path / "models")
    pair = {"prompt": "what is the answer", "chosen": "fine tuning", "rejected": "other words"}
    data = ["data=jsonl", f"data.path={write_jsonl(tmp_path / 'pairs.jsonl', [pair] * 8)}"]
    data += ["data.val_fraction=0.25", "model=pretrained", "train.warmup_steps=0"]
    one_step = ["train.max_steps=1", "train.global_batch_size=2", "train.micro_batch_size=1"]
    policy = f"model.pretrained_path={folders['policy']}"
    dpo(
        tmp_path / "trained",
        *data,
        *one_step,
        policy,
        "train.val_every=1",
        "checkpoint.export=true",
    )
    exported = f"model.pretrained_path={tmp_path / 'trained' / 'hf'}"
    reference = f"dpo.reference_path={folders['policy']}"
    dpo(tmp_path / "again", *data, *one_step, exported, reference)
    [validated], [again] = metrics(tmp_path / "trained"), metrics(tmp_path / "again")
    assert validated["val_loss"] != pytest.approx(math.log(2), abs=1e-4)  # the policy moved
    scale = abs(again["logps/chosen"]) + abs(again["logps/rejected"])
    for name in DPO_METRICS:
        within = dict(abs=1e-5 * scale) if name.startswith("rewards/") else dict(rel=1e-5)
        assert validated[f"val_{name}"] == pytest.approx(again[name], **within), name


# An MoE policy's load-balancing loss on (Hugging Face's router_aux_loss_coef, 0.5 here), so the
# backward holds it: each layout against its tp=1 twin (sp pads the pairs to 16 positions, not 8:
# the loss counts real tokens alone; dp=2's ranks take dp=1's micro-batches, the loss's rows).
AUX = ["+model.config.output_router_logits=true", "+model.config.router_aux_loss_coef=0.5"]
MOE_TWINS = {  # a layout -> its overrides and its tp=1 twin's
    "qwen3_moe_tp2_ep2": (["model=qwen3_moe", *AUX, "tp=2", "ep=2"], ["model=qwen3_moe", *AUX]),
    "qwen3_moe_tp2_sp": (["model=qwen3_moe", *AUX, "tp=2", "sp=true"], ["model=qwen3_moe", *AUX]),
    "qwen3_moe_dp2_ep2": (["model=qwen3_moe", *AUX, "dp=2", "ep=2"], ["model=qwen3_moe", *AUX]),
    "mixtral_sgd_dp2_ep2": (
        ["model=mixtral", *AUX, *SGD, "dp=2", "ep=2"],
        ["model=mixtral", *AUX, *SGD],
    ),
    "qwen3_moe_lora_tp2_ep2": (
        ["model=qwen3_moe", *LORA, "tp=2", "ep=2"],
        ["model=qwen3_moe", *LORA],
    ),
}


@pytest.fixture(scope="module")
def once(tmp_path_factory):
    """``dpo.py`` with some overrides, run once for the module (a twin several layouts share)."""
    root, done = tmp_path_factory.mktemp("dpo_once"), {}

    def run(*overrides: str) -> list[dict]:
        if overrides not in done:
            done[overrides] = root / str(len(done))
            dpo(done[overrides], *overrides)
        return metrics(done[overrides])

    return run


@pytest.mark.parametrize("name", list(MOE_TWINS))
def test_an_moe_policy_at_each_layout_equals_its_tp1_twin(once, name):
    """Experts split over ep (with tp or dp): the loss, grad norm, every DPO metric and the
    expert imbalance within 1e-5 of tp=1 over 4 steps (rewards: of the log-probabilities' scale);
    the reference is the starting weights, split as the policy is."""
    layout, twin = MOE_TWINS[name]
    for ours, theirs in zip(once(*layout), once(*twin), strict=True):
        scale = abs(theirs["logps/chosen"]) + abs(theirs["logps/rejected"])
        for key in (*DPO_METRICS, "grad_norm", "expert_imbalance"):
            within = dict(abs=1e-5 * scale) if key.startswith("rewards/") else dict(rel=1e-5)
            assert ours[key] == pytest.approx(theirs[key], **within), key


def test_the_load_balancing_loss_joins_an_moe_policys_backward(once):
    """With ``output_router_logits`` the first step's loss is the same (log 2: policy =
    reference) and its grad norm is not: the router's loss term is in the gradients."""
    aux, plain = once("model=qwen3_moe", *AUX)[0], once("model=qwen3_moe")[0]
    assert aux["loss"] == pytest.approx(plain["loss"], rel=1e-7)
    assert aux["grad_norm"] > plain["grad_norm"] * 1.05
