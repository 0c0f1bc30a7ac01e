"""``peft=qlora`` through the command line: tp=2, dp=2 (the NF4 base sharded by FSDP), and dp=2 ×
tp=2 with sp, equal the tp=1 run step by step (the NF4 tiles do not depend on the layout), and so
does qwen3_moe at tp=2 ep=2 with per-expert adapters; dp=2's checkpoint holds no NF4 base and a
resume from it continues exactly; the adapter is exported in PEFT's format, and the merged export
is the NF4 round trip of the base plus alpha/r · B·A in the base's dtype, the other weights bitwise
the base's. The 4-rank dp=2 × tp=2 sp twin runs under ``-m sweep`` only."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader
from transformers import AutoModelForCausalLM

from components.checkpoint.dcp import checkpoint_path
from tests.e2e.test_lora import assert_same_run
from tests.e2e.test_recipe_training import metrics, recipe
from tests.selection import selected_params
from tests.unit.models.test_qlora import round_trip

QLORA = ["peft=qlora", "optim.lr=1e-2", "train.max_steps=4"]
EXPORT = ["checkpoint.export=true", "peft.merge=true"]
MOE = ["model=qwen3_moe", "peft.experts=true"]
RUNS = {
    "tp1": ["tp=1"],
    "tp2": ["tp=2", *EXPORT],
    "dp2": ["dp=2", "checkpoint.every_steps=2", *EXPORT],
    "dp2_tp2_sp": ["tp=2", "dp=2", "sp=true"],
    "moe_tp1": MOE,
    "moe_tp2_ep2": [*MOE, "tp=2", "ep=2", *EXPORT],
}
TWINS = {"tp2": "tp1", "dp2": "tp1", "dp2_tp2_sp": "tp1", "moe_tp2_ep2": "moe_tp1"}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qlora")
    selected = selected_params(request, "name")
    names = [name for name in RUNS if name != "dp2_tp2_sp" or name in selected]  # -m sweep
    for name in names:
        recipe(root / name, *QLORA, *RUNS[name])
    return {name: root / name for name in names}


@pytest.mark.parametrize(
    "name", ["tp2", "dp2", "moe_tp2_ep2", pytest.param("dp2_tp2_sp", marks=pytest.mark.sweep)]
)
def test_qlora_runs_match_their_tp1_twin_step_by_step(runs, name):
    assert_same_run(runs[name], runs[TWINS[name]])


def test_a_dp2_checkpoint_holds_no_nf4_base_and_a_resume_from_it_continues_exactly(runs, tmp_path):
    """The NF4 base is quantized again on resume, not saved: dp=2's checkpoint of step 2 holds
    the adapters and the unquantized weights alone, and resumed at dp=2 (its tiles sharded by
    FSDP again) steps 3 and 4 are the uninterrupted run's."""
    step_2 = checkpoint_path(runs["dp2"] / "checkpoints", 2)
    saved = FileSystemReader(step_2).read_metadata().state_dict_metadata
    model = [key for key in saved if key.startswith("model.")]
    assert any(".lora_A." in key for key in model) and "model.model.norm.weight" in model
    assert not [key for key in model if ".nf4." in key or key.endswith("_proj.weight")]
    resume = ("dp=2", "peft.merge=true", f"checkpoint.resume={step_2}")  # as it was written
    resumed = recipe(tmp_path / "resumed", *QLORA, *resume)
    assert [record["step"] for record in resumed] == [3, 4]
    for ours, theirs in zip(resumed, metrics(runs["dp2"])[2:], strict=True):
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
        assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)


@pytest.mark.parametrize("name", ["tp2", "dp2", "moe_tp2_ep2"])
def test_the_merged_export_is_the_nf4_base_plus_scaled_ba(runs, name):
    folder = runs[name]
    config = json.loads((folder / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["base_model_name_or_path"] == str(folder / "base")
    adapters = load_file(folder / "adapter" / "adapter_model.safetensors")
    base = AutoModelForCausalLM.from_pretrained(folder / "base").state_dict()
    merged = AutoModelForCausalLM.from_pretrained(folder / "hf")
    assert merged.dtype == torch.float32  # the base's
    exported, adapted = merged.state_dict(), 0
    for key, weight in base.items():
        prefix = f"base_model.model.{key.removesuffix('.weight')}"
        if f"{prefix}.lora_A.weight" not in adapters:
            if ".experts." not in key:  # the experts' merge (unquantized): tests/e2e/test_lora.py
                assert torch.equal(exported[key], weight), key  # untrained
            continue
        delta = adapters[f"{prefix}.lora_B.weight"] @ adapters[f"{prefix}.lora_A.weight"]
        assert delta.abs().sum() > 0, key
        expected = round_trip(weight) + 2.0 * delta  # alpha 16 / rank 8
        torch.testing.assert_close(exported[key], expected, rtol=1e-6, atol=1e-6)
        adapted += 1
    assert adapted == (2 * 4 if name == "moe_tp2_ep2" else 2 * 7)  # the dense projections
