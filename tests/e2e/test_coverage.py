"""The coverage table's sweep (tests/coverage.py, which ``bench/coverage.py`` runs over every
causal-LM model type of transformers) on two of them at tp=1 and tp=2, each a tiny model its own
config class builds, shrunk and written by ``save_pretrained``: Llama trains at both; Gemma 3's
image-text model (a composite config) trains its text at tp=1 and is refused at tp=2 in one line;
Doge (its own plan corrected) trains at tp=2 and tp=2 sp=true as at tp=1; the layouts that can be
silently wrong (pp=2, cp=2, LoRA at tp=2, fp8) on Llama (its own plan) and OPT (a derived one).
How a run is classified; and, opt-in
(``pytest -m coverage``), the whole sweep held to the coverage goal.

By default Doge runs at tp=2 sp=true (its corrected plan and its residual scales under sequence
parallelism), a new column's test once per plan kind (Llama's own, OPT's derived); Doge at plain
tp=2, the same corrected plan without sp, under ``-m sweep``.
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
    causal_lm_types,
    classify,
    compare,
    render,
    sweep_type,
    tiny_config,
)
from tests.saved_models import REPO
from tests.selection import selected_params

REFUSAL = (
    "error: model type 'gemma3' has no tensor-parallel plan, and its decoder layers "
    "(one nn.ModuleList) were not found"
)


@pytest.fixture(scope="module")
def entries(request, tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("coverage")
    tokenizer = train_tokenizer(["hello world", "tune"], DEFAULT_VOCAB_SIZE, root / "tokenizer")
    silent = ("pp2", "cp2", "lora", "fp8")  # the layouts that can be silently wrong
    return [
        sweep_type("llama", root, tokenizer, ("tp1", "tp2", *silent)),
        sweep_type("gemma3", root, tokenizer, ("tp1", "tp2")),
        sweep_type("doge", root, tokenizer, ("tp1", *selected_params(request, "doge_layout"))),
        sweep_type("opt", root, tokenizer, ("tp1", *silent)),  # a derived plan
    ]


def test_llama_trains_at_tp2_as_at_tp1_and_gemma3_image_text_is_refused_at_tp2(entries):
    llama, gemma3, _, _ = (entry["results"] for entry in entries)
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


def test_the_layouts_that_can_be_silently_wrong_train_as_tp1_or_are_refused(entries):
    """pp=2, cp=2, LoRA (on every linear, lm_head among them) and fp8 on a type with a plan of its
    own (Llama) and one with a derived plan (OPT, whose learned positions pp refuses)."""
    llama, opt = entries[0]["results"], entries[3]["results"]
    for layout in ("pp2", "cp2"):
        assert llama[layout]["losses"] == pytest.approx(llama["tp1"]["losses"], rel=1e-5)
        assert opt[layout]["status"] == ("refused" if layout == "pp2" else "works")
    assert opt["cp2"]["losses"] == pytest.approx(opt["tp1"]["losses"], rel=1e-5)
    assert opt["pp2"]["line"].startswith("error: pp=2 with model type 'opt' is not supported yet")
    for results in (llama, opt):
        lora, reference = results["lora"], results["lora_tp1"]
        assert lora["status"] == reference["status"] == "works", (lora["line"], reference["line"])
        assert reference["losses"][0] == pytest.approx(results["tp1"]["losses"][0], rel=1e-5)
        assert reference["losses"][1:] != pytest.approx(results["tp1"]["losses"][1:], rel=1e-3)
        assert lora["losses"] == pytest.approx(reference["losses"], rel=1e-5)
        assert results["fp8"]["losses"] == pytest.approx(results["tp1"]["losses"], rel=2e-2)
        assert results["fp8"]["losses"] != pytest.approx(results["tp1"]["losses"], rel=1e-6)


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
