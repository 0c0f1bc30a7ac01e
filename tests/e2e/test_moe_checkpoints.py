"""MoE folders as transformers' own ``save_pretrained`` writes them (one tensor per expert), through
the command line: Qwen2-MoE, OLMoE, DeepSeek-V3 and Granite-MoE load through transformers'
checkpoint conversion rules, their experts and routers found from their structure. Each trains at
tp=1 with the Hugging Face model's own first loss (1e-6) and at tp=2 ep=2 (with sp=true for two of
them) equal to tp=1 (1e-5), reporting ``expert_imbalance``; that split run exports, and the export
reloads with ``from_pretrained`` as the trained model. GPT-OSS (expert biases, clamped SwiGLU,
attention sinks sharded with the heads, on a plan derived from its structure) and Llama 4 (top-1
router with a shared expert, experts handed tokens already routed, its own plan written for dense
and MoE layers) do likewise at tp=1, tp=2 and tp=2 ep=2, the export of the last reloading as
trained. ``make test`` trains DeepSeek-V3 (a dense layer, a shared expert, attention outside its
plan, sp; its split run serves the export test too) and GPT-OSS; the other families' runs are
opt-in with ``-m sweep``.
"""

import json
from pathlib import Path

import pytest
from safetensors import safe_open
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    GptOssConfig,
    GraniteMoeConfig,
    Llama4TextConfig,
    OlmoeConfig,
    Qwen2MoeConfig,
)

from components.data import DEFAULT_VOCAB_SIZE, train_tokenizer
from tests.saved_models import (
    BATCH,
    MICRO,
    SEQ_LEN,
    SIZES,
    first_loss,
    recipe,
    save_model,
    validation_loss,
)

MOE = dict(SIZES, vocab_size=288, num_experts_per_tok=2)  # vocab even: split at tp=2
CONFIGS = {
    "qwen2_moe": lambda: Qwen2MoeConfig(
        **MOE, num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=64
    ),
    "olmoe": lambda: OlmoeConfig(**MOE, num_experts=4),
    "deepseek_v3": lambda: DeepseekV3Config(
        **{**MOE, "num_key_value_heads": 4},  # its attention wants as many as heads
        n_routed_experts=4,
        moe_intermediate_size=32,
        first_k_dense_replace=1,  # layer 0 dense, layer 1 MoE with a shared expert
        n_group=2,
        topk_group=1,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
    ),
    "granitemoe": lambda: GraniteMoeConfig(**MOE, num_local_experts=4),
    "gpt_oss": lambda: GptOssConfig(
        **MOE,
        num_local_experts=4,
        head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},  # YaRN warns at 128
    ),
    "llama4": lambda: Llama4TextConfig(
        **{**MOE, "num_experts_per_tok": 1, "intermediate_size": 32},
        num_local_experts=4,
        head_dim=16,
        intermediate_size_mlp=128,
        interleave_moe_layer_step=2,  # layer 0 dense, layer 1 MoE
    ),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    tokenizer = train_tokenizer(["hello world", "tune"], DEFAULT_VOCAB_SIZE, root / "tokenizer")
    assert len(tokenizer) <= MOE["vocab_size"]
    saved = {name: save_model(root / name, config(), tokenizer) for name, config in CONFIGS.items()}
    return {"cache": root / "cache", **saved}


@pytest.fixture(scope="module")
def split_runs(folders, tmp_path_factory):
    """``split(model, layout)``: the run of ``model`` at ``layout``, exported, made the first
    time a test asks for it (the parity test and the export test read the same run)."""
    root, made = tmp_path_factory.mktemp("split"), {}

    def split(model: str, layout: str) -> tuple[Path, list[dict]]:
        if (model, layout) not in made:
            output = root / model
            export = ("checkpoint.export=true", "train.val_every=3")
            made[model, layout] = output, run(folders, model, output, *layout.split(), *export)
        return made[model, layout]

    return split


def run(folders, model: str, output_dir: Path, *overrides: str) -> list[dict]:
    result = recipe(folders, model, output_dir, "optim=sgd", *overrides)
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def test_save_pretrained_writes_one_tensor_per_expert(folders):
    with safe_open(folders["qwen2_moe"] / "model.safetensors", "pt") as stored:
        keys = set(stored.keys())
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in keys
    assert "model.layers.1.mlp.experts.gate_up_proj" not in keys


@pytest.mark.parametrize(
    ("model", "split"),
    [
        ("deepseek_v3", "tp=2 ep=2 sp=true"),  # its attention, not in its plan, on whole tokens
        pytest.param("qwen2_moe", "tp=2 ep=2", marks=pytest.mark.sweep),
        # q/k/v gathered, then split (rowwise_split_input)
        pytest.param("olmoe", "tp=2 ep=2 sp=true", marks=pytest.mark.sweep),
        pytest.param("granitemoe", "tp=2 ep=2", marks=pytest.mark.sweep),
    ],
)
def test_a_saved_moe_trains_at_tp1_as_hf_and_split_as_tp1(
    folders, split_runs, tmp_path, model, split
):
    tp1 = run(folders, model, tmp_path / "tp1", "tp=1")
    _, split = split_runs(model, split)
    losses = [record["loss"] for record in tp1]
    assert len(set(losses)) == 3  # the steps train
    assert [r["loss"] for r in split] == pytest.approx(losses, rel=1e-5, abs=1e-5)
    assert all(r["expert_imbalance"] >= 1.0 for r in tp1 + split)
    reference = first_loss(folders[model], folders["cache"], SEQ_LEN, BATCH, MICRO)
    assert losses[0] == pytest.approx(reference, abs=1e-6)


def test_the_export_of_a_split_run_reloads_as_the_trained_model(folders, split_runs):
    """DeepSeek-V3's tp=2 ep=2 sp run (one tensor per expert in its folder, as Qwen2-MoE's)."""
    output, records = split_runs("deepseek_v3", "tp=2 ep=2 sp=true")
    reference = first_loss(folders["deepseek_v3"], folders["cache"], SEQ_LEN, BATCH, MICRO)
    assert records[0]["loss"] == pytest.approx(reference, abs=1e-5)
    reloads_as_trained(folders, output, records)


def reloads_as_trained(folders, output: Path, records: list[dict]) -> None:
    _, info = AutoModelForCausalLM.from_pretrained(output / "hf", output_loading_info=True)
    assert not any(info.values()), info  # nothing missing, unexpected or mismatched
    reloaded = validation_loss(output / "hf", folders["cache"], SEQ_LEN)
    assert reloaded == pytest.approx(records[-1]["val_loss"], rel=1e-5)


@pytest.mark.parametrize("model", ["gpt_oss", pytest.param("llama4", marks=pytest.mark.sweep)])
def test_gpt_oss_and_llama4_train_at_tp2_and_ep2_as_at_tp1_and_export(folders, tmp_path, model):
    tp1 = run(folders, model, tmp_path / "tp1", "tp=1")
    tp2 = run(folders, model, tmp_path / "tp2", "tp=2")
    export = ("checkpoint.export=true", "train.val_every=3")
    ep2 = run(folders, model, tmp_path / "ep2", "tp=2", "ep=2", *export)
    losses = [record["loss"] for record in tp1]
    assert len(set(losses)) == 3  # the steps train
    for split in (tp2, ep2):
        assert [r["loss"] for r in split] == pytest.approx(losses, rel=1e-5, abs=1e-5)
    assert all(r["expert_imbalance"] >= 1.0 for r in tp1 + tp2 + ep2)
    reference = first_loss(folders[model], folders["cache"], SEQ_LEN, BATCH, MICRO)
    assert losses[0] == pytest.approx(reference, abs=1e-6)
    reloads_as_trained(folders, tmp_path / "ep2", ep2)


def test_llama4_experts_where_they_cannot_split_are_one_error_line(folders, tmp_path):
    result = recipe(folders, "llama4", tmp_path / "run", "tp=2", "ep=4", "dp=2")
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and len(lines) == 1, result.stderr[-4000:]
    assert lines[0].startswith("error: ") and "split only where ep divides tp" in lines[0]
