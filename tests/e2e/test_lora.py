"""``peft=lora`` through the command line: tp=2 and dp=2 × tp=2 with sp equal the tp=1 run step by
step, and so does qwen3_moe at tp=2 ep=2 with per-expert adapters (``peft.experts=true``); a resume
at another tp equals the uninterrupted run; the optimizer holds the adapters' state alone; the
adapter export loads with peft, and the merged export is base + alpha/r · B·A, experts included.
The dense runs adapt ``lm_head`` too: under the chunked loss (the default) it trains and equals the
unchunked run (AdamW and SGD); a target pattern that matches nothing is one error line. The
4-rank dp=2 × tp=2 sp twin runs under ``-m sweep`` only: tp=2 and the head's adapter alone at tp=2
sp prove its paths in make test."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from peft import AutoPeftModelForCausalLM, PeftModel
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from components.checkpoint.dcp import checkpoint_path
from components.models import build_causal_lm
from tests import cli
from tests.e2e.test_recipe_training import COMMON, REPO, metrics, recipe
from tests.selection import selected_params

ADAPTERS = ["peft=lora", "peft.rank=4", "peft.alpha=8.0"]
LORA = [*ADAPTERS, "optim.lr=1e-2"]
WITH_HEAD = [*LORA, "peft.target_modules=[lm_head,*_proj]"]  # the head and every projection
UNCHUNKED = "train.loss_chunk_tokens=0"  # the head's own forward, then the loss
SGD = [*ADAPTERS, "optim=sgd", "peft.target_modules=[lm_head,*.q_proj]"]  # lr 0.1
TYPO = "peft.target_modules=[*.q_proj,*.nothing]"
TP2 = ["tp=2", "checkpoint.export=true", "peft.merge=true", "checkpoint.every_steps=3"]
# FSDP, validated after the last step: the forward alone leaves FSDP's root (the head) gathered
DP2 = ["dp=2", "checkpoint.export=true", "peft.merge=true", "train.val_every=2"]
MOE = ["model=qwen3_moe", "peft.experts=true", "train.max_steps=4"]
MOE_TP2_EP2 = [*MOE, "tp=2", "ep=2", "checkpoint.export=true", "peft.merge=true"]
# run: its twin (tp=1, or the same run with the unchunked loss)
TWINS = {"tp2": "tp1", "dp2_tp2_sp": "tp1", "moe_tp2_ep2": "moe_tp1", "tp1": "tp1_unchunked"}
TWINS |= {"sgd": "sgd_unchunked"}


def refused(output_dir: Path, *overrides: str) -> list[str]:
    """The recipe's stderr lines for a run that must exit with status 2 before any rank starts."""
    command = [sys.executable, "recipes/finetune.py", *COMMON, f"output_dir={output_dir}"]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = cli.run(
        [*command, *overrides], cwd=REPO, capture_output=True, text=True, env=environment
    )
    assert result.returncode == 2, result.stderr[-4000:]
    return result.stderr.strip().splitlines()


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    dense = {"tp1": ["tp=1"], "tp2": TP2, "tp1_unchunked": [UNCHUNKED], "dp2_validated": DP2}
    if "dp2_tp2_sp" in selected_params(request, "name"):
        dense |= {"dp2_tp2_sp": ["tp=2", "dp=2", "sp=true"]}
    for name, overrides in dense.items():
        recipe(root / name, *WITH_HEAD, *overrides)
    moe = {"moe_tp1": MOE, "moe_tp2_ep2": [*MOE_TP2_EP2, "checkpoint.every_steps=4"]}
    for name, overrides in moe.items():
        recipe(root / name, *LORA, *overrides)
    (root / "sgd.typo").write_text("\n".join(refused(root / "sgd", *SGD[:-1], TYPO)))
    recipe(root / "sgd", *SGD, "checkpoint.export=true")  # corrected, into the refused folder
    recipe(root / "sgd_unchunked", *SGD, UNCHUNKED)
    alone = [*LORA, "peft.target_modules=[lm_head]", "tp=2", "sp=true", "checkpoint.export=true"]
    recipe(root / "head_alone", *alone)
    return {name: root / name for name in [*dense, *moe, "sgd", "sgd_unchunked", "head_alone"]}


@pytest.mark.parametrize(
    "name",
    ["tp2", "moe_tp2_ep2", "tp1", "sgd", pytest.param("dp2_tp2_sp", marks=pytest.mark.sweep)],
)
def test_lora_runs_match_their_twin_step_by_step(runs, name):
    """Each layout its tp=1 run; the chunked loss the unchunked one, with an adapter on lm_head."""
    assert_same_run(runs[name], runs[TWINS[name]])


def assert_same_run(run: Path, twin: Path) -> None:
    """``run``'s loss and grad norm equal ``twin``'s at each step (within 1e-5); its loss fell."""
    reference = metrics(twin)
    assert reference[-1]["loss"] < reference[0]["loss"]
    for ours, theirs in zip(metrics(run), reference, strict=True):
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
        assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)


def lm_head_B(folder: Path) -> torch.Tensor:
    return load_file(folder / "adapter" / "adapter_model.safetensors")[
        "base_model.model.lm_head.lora_B.weight"
    ]


@pytest.mark.parametrize("name", ["sgd", "tp2", "head_alone"])
def test_an_adapter_on_lm_head_trains_under_the_chunked_loss(runs, name):
    """B starts at zero: after 6 steps it is not, alone on the head at tp=2 with sp too (B split
    over the vocabulary as the head), whose loss falls."""
    assert lm_head_B(runs[name]).abs().amax() > 1e-4
    if name == "head_alone":
        config = json.loads((runs[name] / "adapter" / "adapter_config.json").read_text())
        assert config["target_modules"] == ["lm_head"]
        records = metrics(runs[name])
        assert len(records) == 6 and records[-1]["loss"] < records[0]["loss"]


def test_a_pattern_that_matches_nothing_is_one_error_line_and_the_corrected_rerun_trains(runs):
    """The typo was refused into the folder the SGD run then trained in (the fixture's order)."""
    lines = (runs["sgd"].parent / "sgd.typo").read_text().splitlines()
    assert lines == [
        "error: peft.target_modules pattern '*.nothing' matches no module of LlamaForCausalLM: fix "
        "or remove it (module names such as 'model.layers.0.self_attn.q_proj', 'lm_head')"
    ]
    assert len(metrics(runs["sgd"])) == 6


def test_resume_at_another_tp_equals_the_uninterrupted_run_with_adapter_state_alone(runs, tmp_path):
    """The tp=2 run's checkpoint of step 3 holds the optimizer state of the adapters alone, and
    resumed at tp=1 its steps 4 to 6 are the uninterrupted tp=1 run's."""
    step_3 = checkpoint_path(runs["tp2"] / "checkpoints", 3)
    saved = FileSystemReader(step_3).read_metadata()
    state = {k: v for k, v in saved.state_dict_metadata.items() if k.startswith("optim.state.")}
    saved_model = {k: v for k, v in saved.state_dict_metadata.items() if k.startswith("model.")}
    adapters = {k: v for k, v in saved_model.items() if ".lora_" in k}
    moments = [k for k in state if k.endswith(("exp_avg", "exp_avg_sq"))]
    assert moments and all(".lora_" in k for k in state)  # no state for the frozen base
    numel = sum(state[k].size.numel() for k in moments)
    assert numel == 2 * sum(v.size.numel() for v in adapters.values())  # AdamW's two moments
    assert len(adapters) < len(saved_model)  # the frozen base is saved too

    resume = ("tp=1", "peft.merge=true", f"checkpoint.resume={step_3}")  # as it was written
    resumed = recipe(tmp_path / "resumed", *WITH_HEAD, *resume)
    assert [record["step"] for record in resumed] == [4, 5, 6]
    uninterrupted = metrics(runs["tp1"])
    for ours, theirs in zip(resumed, uninterrupted[3:], strict=True):
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5)


def test_expert_adapters_are_in_the_checkpoint_and_hold_the_optimizer_state_alone(runs):
    saved = FileSystemReader(checkpoint_path(runs["moe_tp2_ep2"] / "checkpoints", 4))
    entries = saved.read_metadata().state_dict_metadata
    adapters = {k: v.size for k, v in entries.items() if k.startswith("model.") and ".lora_" in k}
    experts = {k: size for k, size in adapters.items() if ".mlp.experts.lora_" in k}
    assert len(experts) == 2 * 2 * 2  # A and B of gate_up_proj and down_proj in 2 layers
    assert all(size[0] == 8 for size in experts.values())  # whole: every expert's, 8
    moments = [v.size for k, v in entries.items() if k.endswith(("exp_avg", "exp_avg_sq"))]
    assert sum(s.numel() for s in moments) == 2 * sum(s.numel() for s in adapters.values())


def _expert_delta(adapters: dict, prefix: str, experts: int) -> torch.Tensor:
    """PEFT's ParamWrapper update of a [E, out, in] weight from its saved A [E·r, in] and B
    [out, r·E] (peft/tuners/lora/layer.py, get_delta_weight): B_e·A_e for each expert e."""
    A, B = adapters[f"{prefix}.lora_A.weight"], adapters[f"{prefix}.lora_B.weight"]
    A, B = A.reshape(experts, -1, A.shape[-1]), B.reshape(B.shape[0], -1, experts)
    return torch.einsum("o r e, e r i -> e o i", B, A)


def _merged_is_base_plus_scaled_ba(folder: Path, merged: torch.nn.Module, config) -> None:
    adapters = load_file(folder / "adapter" / "adapter_model.safetensors")
    base = build_causal_lm(config, seed=0).state_dict()
    exported, experts = merged.state_dict(), getattr(config, "num_experts", 0)
    nested = {"gate_up_proj": "base_layer.", "down_proj": ""}  # PEFT's ParamWrapper nesting
    for name, weight in base.items():
        module, _, kind = name.rpartition(".")
        prefix = f"base_model.model.{module}"
        if kind in nested and f"{prefix}.{nested[kind]}lora_A.weight" in adapters:
            delta = _expert_delta(adapters, f"{prefix}.{nested[kind]}".rstrip("."), experts)
        elif f"{prefix}.lora_A.weight" in adapters and kind == "weight":
            delta = adapters[f"{prefix}.lora_B.weight"] @ adapters[f"{prefix}.lora_A.weight"]
        else:
            assert torch.equal(exported[name], weight), name  # frozen: bitwise the source's
            continue
        assert delta.abs().sum() > 0, name  # trained
        torch.testing.assert_close(exported[name], weight + 2.0 * delta, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["tp2", "moe_tp2_ep2", "dp2_validated"])
def test_adapter_export_loads_with_peft_and_the_merged_export_is_base_plus_scaled_ba(runs, name):
    folder = runs[name]
    config = AutoConfig.from_pretrained(folder / "hf")
    adapter_config = json.loads((folder / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["r"] == 4
    if name.startswith("moe"):
        assert len(adapter_config["target_parameters"]) == 2 * 2  # both weights, 2 layers
    ids = torch.arange(1, 40)[None]
    with torch.no_grad():
        loaded = PeftModel.from_pretrained(build_causal_lm(config, seed=0), folder / "adapter")
        merged = AutoModelForCausalLM.from_pretrained(folder / "hf")
        torch.testing.assert_close(
            loaded(input_ids=ids).logits, merged(input_ids=ids).logits, rtol=1e-5, atol=1e-5
        )
        # alone: built from its config, the base is the run's seeded weights, written to base/
        assert adapter_config["base_model_name_or_path"] == str(folder / "base")
        alone = AutoPeftModelForCausalLM.from_pretrained(folder / "adapter")
        torch.testing.assert_close(
            alone(input_ids=ids).logits, merged(input_ids=ids).logits, rtol=1e-5, atol=1e-5
        )
    tokenizer = AutoTokenizer.from_pretrained(folder / "adapter")  # beside it, as TRL saves it
    assert tokenizer.get_vocab() == AutoTokenizer.from_pretrained(folder / "hf").get_vocab()
    _merged_is_base_plus_scaled_ba(folder, merged, config)


def test_lora_on_a_pretrained_folder_loads_it_on_meta_and_names_it_in_the_adapter(runs, tmp_path):
    folder = runs["tp2"] / "hf"
    pretrained = ["model=pretrained", f"model.pretrained_path={folder}", "checkpoint.export=true"]
    run = tmp_path / "pretrained"
    records = recipe(run, *WITH_HEAD, *pretrained, "tp=2", "train.max_steps=2", "peft.merge=true")
    assert len(records) == 2
    config = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(folder)
    assert not (run / "base").exists()  # the pretrained folder is the base
    ids = torch.arange(1, 40)[None]
    with torch.no_grad():
        alone = AutoPeftModelForCausalLM.from_pretrained(run / "adapter")(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(run / "hf")(input_ids=ids).logits
    torch.testing.assert_close(alone, merged, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(alone, AutoModelForCausalLM.from_pretrained(folder)(ids).logits)
