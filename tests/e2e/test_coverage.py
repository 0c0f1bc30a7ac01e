"""The coverage table's sweep (tests/coverage.py, which ``bench/coverage.py`` runs over every
causal-LM model type of transformers) on a few of them, each a tiny model its own config class
builds, shrunk and written by ``save_pretrained``: Llama trains at tp=1 and tp=2; Gemma 3's
image-text model (a composite config) trains its text at tp=1 and is refused at tp=2 in one line;
Doge (its own plan corrected) trains at tp=2 and tp=2 sp=true as at tp=1. The layouts that can be
silently wrong (pp=2, cp=2, LoRA at tp=2, fp8), a test each, on one type of each plan kind: Llama
(its own), OPT (a derived one; StableLM where pp=2 refuses OPT) and Qwen3.5 (its text config's);
CamemBERT, refused at tp=1, refused at cp=2 too. How a run is classified and how the page keeps
each refusal's whole line; and, opt-in (``pytest -m coverage``), the whole sweep held to the
coverage goal.

By default Doge runs at tp=2 sp=true (its corrected plan and its residual scales under sequence
parallelism); Doge at plain tp=2, the same corrected plan without sp, under ``-m sweep``.
"""

import json
import subprocess
import sys

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from components.data import DEFAULT_VOCAB_SIZE, train_tokenizer
from components.models.build import decoder_blocks
from tests.coverage import (
    Result,
    as_json,
    causal_lm_types,
    classify,
    compare,
    sweep_type,
    tiny_config,
)
from tests.coverage_page import entries_from_table, render
from tests.saved_models import REPO
from tests.selection import selected_params

CP_HYBRID = (
    "error: cp=2 with a model with full_attention, linear_attention layers "
    "(model.config.layer_types) is not supported: use cp=1"
)
CAMEMBERT = "error: model type 'camembert' numbers its positions from padding_idx + 1"
REFUSAL = (
    "error: model type 'gemma3' has no tensor-parallel plan, and its decoder layers "
    "(one nn.ModuleList) were not found"
)


SILENT = ("pp2", "cp2", "lora", "fp8")  # the layouts that can be silently wrong


@pytest.fixture(scope="module")
def entries(request, tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("coverage")
    tokenizer = train_tokenizer(["hello world", "tune"], DEFAULT_VOCAB_SIZE, root / "tokenizer")
    return [
        sweep_type("llama", root, tokenizer, ("tp1", "tp2", *SILENT)),  # its own plan
        sweep_type("gemma3", root, tokenizer, ("tp1", "tp2")),
        sweep_type("doge", root, tokenizer, ("tp1", *selected_params(request, "doge_layout"))),
        sweep_type("opt", root, tokenizer, ("tp1", *SILENT)),  # a derived plan
        sweep_type("stablelm", root, tokenizer, ("tp1", "pp2")),  # derived, and pp=2 works
        sweep_type("qwen3_5", root, tokenizer, ("tp1", *SILENT)),  # its text config's plan
        sweep_type("camembert", root, tokenizer, ("tp1", "cp2")),  # refused at tp=1
    ]


@pytest.fixture(scope="module")
def results(entries) -> dict[str, dict]:
    """Each swept type's results, by type."""
    return {entry["type"]: entry["results"] for entry in entries}


def test_llama_trains_at_tp2_as_at_tp1_and_gemma3_image_text_is_refused_at_tp2(entries):
    llama, gemma3 = (entry["results"] for entry in entries[:2])
    assert not any(entry["built"] for entry in entries)
    assert llama["tp1"]["status"] == gemma3["tp1"]["status"] == "works"
    assert len(set(llama["tp1"]["losses"])) == len(set(gemma3["tp1"]["losses"])) == 3
    assert llama["tp2"]["status"] == "works"  # within 1e-5 of tp=1 (compare)
    assert llama["tp2"]["losses"] == pytest.approx(llama["tp1"]["losses"], rel=1e-5)
    assert gemma3["tp2"] == {"status": "refused", "line": REFUSAL, "losses": None}
    table = render(
        entries[:2], "python bench/coverage.py --only llama,gemma3", len(causal_lm_types())
    )
    assert (
        "| llama | yes | no | works | works | — | — | works | works | works | works |  |" in table
    )
    cells = "| gemma3 | text config's | no | works | refused | — | — | — | — | — | — |"
    assert f"{cells} tp=2: {REFUSAL} |" in table
    assert "- pp=2: 20" in table  # when each column was measured


@pytest.mark.parametrize("doge_layout", [pytest.param("tp2", marks=pytest.mark.sweep), "tp2_sp"])
def test_doge_trains_at_tp2_and_with_sequence_parallelism_as_at_tp1(entries, doge_layout):
    """Doge's own plan, corrected (dt_proj's per-head outputs, this rank's heads kept), and under
    sequence parallelism its blocks' own residual scales as replicated DTensors."""
    doge = entries[2]["results"]
    assert doge["tp1"]["status"] == "works" and len(set(doge["tp1"]["losses"])) == 3
    assert doge[doge_layout]["status"] == "works", doge[doge_layout]["line"]
    assert doge[doge_layout]["losses"] == pytest.approx(doge["tp1"]["losses"], rel=1e-5)


def _twin_of_tp1(results: dict, layout: str) -> None:
    """``layout`` works and its losses are tp=1's within 1e-5 (relative)."""
    assert results[layout]["status"] == "works", results[layout]["line"]
    assert results[layout]["losses"] == pytest.approx(results["tp1"]["losses"], rel=1e-5)


def test_pp2_trains_as_tp1_for_each_plan_kind_or_is_refused_in_one_line(results):
    """Two pipeline stages on Llama (its own plan), StableLM (a derived one) and Qwen3.5 (its text
    config's; linear-attention layers among its blocks); OPT's learned positions are refused."""
    for model_type in ("llama", "stablelm", "qwen3_5"):
        _twin_of_tp1(results[model_type], "pp2")
    opt = results["opt"]["pp2"]
    assert opt["status"] == "refused"
    assert opt["line"].startswith("error: pp=2 with model type 'opt' is not supported yet")


def test_cp2_trains_as_tp1_for_each_plan_kind_or_is_refused_in_one_line(results):
    """Context parallelism on Llama (its own plan) and OPT (a derived one); Qwen3.5's
    linear-attention layers are refused (they would see only their rank's share)."""
    for model_type in ("llama", "opt"):
        _twin_of_tp1(results[model_type], "cp2")
    assert results["qwen3_5"]["cp2"] == {"status": "refused", "line": CP_HYBRID, "losses": None}


@pytest.mark.parametrize("model_type", ["llama", "opt", "qwen3_5"])
def test_lora_on_every_linear_trains_at_tp2_as_at_tp1(results, model_type):
    """LoRA on every linear, ``lm_head`` among them: at tp=1 its first loss is the base model's
    (every B starts at zero) and it trains away from it; at tp=2 it equals tp=1 within 1e-5."""
    lora, reference, base = (results[model_type][key] for key in ("lora", "lora_tp1", "tp1"))
    assert lora["status"] == reference["status"] == "works", (lora["line"], reference["line"])
    assert reference["losses"][0] == pytest.approx(base["losses"][0], rel=1e-5)
    assert reference["losses"][1:] != pytest.approx(base["losses"][1:], rel=1e-3)
    assert lora["losses"] == pytest.approx(reference["losses"], rel=1e-5)


@pytest.mark.parametrize("model_type", ["llama", "opt", "qwen3_5"])
def test_fp8_trains_within_its_band_of_tp1(results, model_type):
    """Float8 linears within 2e-2 of fp32 at tp=1 (its documented band), and not fp32 itself."""
    fp8, base = results[model_type]["fp8"], results[model_type]["tp1"]
    assert fp8["status"] == "works", fp8["line"]
    assert fp8["losses"] == pytest.approx(base["losses"], rel=2e-2)
    assert fp8["losses"] != pytest.approx(base["losses"], rel=1e-6)


def test_a_layout_whose_tp1_is_refused_is_a_refusal_of_its_own(results):
    """CamemBERT's positions (from padding_idx + 1) are refused at tp=1; cp=2 runs anyway and is
    refused in its own line, a cell of the table rather than a skipped one."""
    camembert = results["camembert"]
    assert camembert["tp1"]["status"] == camembert["cp2"]["status"] == "refused"
    assert camembert["cp2"]["line"].startswith(CAMEMBERT)
    assert camembert["cp2"]["losses"] is None


def test_the_tiny_model_of_a_bart_kin_type_is_shrunk_where_its_causal_lm_runs():
    """BART's kin map num_hidden_layers to encoder_layers, and their causal LM runs the decoder:
    Blenderbot's went unshrunk (24 layers, feed-forward 10240 wide: its fp8 cell measured that)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config("blenderbot"))
    blocks = decoder_blocks(model)
    assert len(blocks) == 2
    widths = {m.out_features for b in blocks for m in b.modules() if isinstance(m, nn.Linear)}
    assert widths == {64, 128}


def test_a_run_is_works_refused_or_broken(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    one_line = "note: a note\nerror: tp (2) must divide num_key_value_heads (1)\n"
    assert classify(1, one_line, metrics) == Result("refused", one_line.splitlines()[1])
    traceback = "Traceback (most recent call last):\n  ...\nValueError: no plan\n"
    assert classify(1, traceback, metrics) == Result("broken", "ValueError: no plan")
    metrics.write_text('{"loss": 2.0}\n{"loss": 1.5}\n')
    reference = classify(0, "", metrics)
    assert reference == Result("works", losses=[2.0, 1.5])
    assert compare(reference, Result("works", losses=[2.0, 1.5 * (1 + 2e-5)])).status == "broken"
    assert compare(reference, Result("works", losses=[2.0, 1.5 * (1 + 5e-6)])).status == "works"


def test_the_page_shows_each_refusal_whole_and_counts_the_cells_it_fills():
    """A refusal longer than a screen, and one line that names two problems (joined by "; ", as
    the recipe prints them), come back whole from the page; each column counts the types that ran
    it and those skipped."""
    two = "error: pp=2 with an MoE model is not supported yet; pp=2 with model type 'zaya' is not"
    long = "error: " + "x" * 600
    moe = {"tp1": Result("works", losses=[1.0]), "pp2": Result("refused", two)}
    moe |= {"lora_tp1": Result("refused", long), "lora": Result("refused", long)}
    roberta = {"tp1": Result("refused", "error: not causal"), "pp2": Result("skipped", "no tp1")}
    entries = [
        {"type": "zaya", "plan": "", "moe": True, "built": "", "results": as_json(moe)},
        {"type": "roberta", "plan": "", "moe": False, "built": "", "results": as_json(roberta)},
    ]
    entries[0]["measured"] = dict.fromkeys(moe, "2026-12-04 03:16 UTC")
    entries[1]["measured"] = {"tp1": "2026-12-03 to 2026-12-04 11:31 UTC"}
    page = render(entries, "python bench/coverage.py", 2)
    assert "- pp=2: 2026-12-04 03:16 UTC to 2026-12-04 03:16 UTC (1 types, 1 skipped)" in page
    assert "- tp=1: 2026-12-03 to 2026-12-04 11:31 UTC (2 types)" in page
    back = {entry["type"]: entry["results"] for entry in entries_from_table(page, "then")}
    assert back["zaya"]["pp2"]["line"] == two
    assert back["zaya"]["lora"]["line"] == back["zaya"]["lora_tp1"]["line"] == long
    assert back["roberta"]["tp1"]["line"] == "error: not causal"


@pytest.mark.coverage
def test_every_type_with_a_plan_trains_at_tp2_and_the_rest_is_refused(tmp_path):
    results, table = tmp_path / "results", tmp_path / "coverage.md"
    command = [sys.executable, "bench/coverage.py", f"--results={results}", f"--output={table}"]
    subprocess.run(command, cwd=REPO, check=True, timeout=4 * 3600)
    entries = [json.loads(path.read_text()) for path in results.glob("*.json")]
    statuses = {e["type"]: e["results"].get("tp2", {}).get("status") for e in entries}
    broken = sorted(t for t, status in statuses.items() if status not in ("works", "refused"))
    assert not broken, table.read_text()
    with_plan = [e["type"] for e in entries if e["plan"] == "own"]
    assert sum(statuses[t] == "works" for t in with_plan) >= 95, table.read_text()
