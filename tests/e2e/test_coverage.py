"""The coverage table's sweep (tests/coverage.py, which ``bench/coverage.py`` runs over every
causal-LM model type of transformers) on two of them at tp=1 and tp=2, each a tiny model its own
config class builds, shrunk and written by ``save_pretrained``: Llama trains at both; Gemma 3's
image-text model (a composite config) trains its text at tp=1 and is refused at tp=2 in one line;
Doge (its own plan corrected) trains at tp=2 and tp=2 sp=true as at tp=1.
How a run is classified; and, opt-in
(``pytest -m coverage``), the whole sweep held to the coverage goal.
"""

import json
import subprocess
import sys

import pytest

from components.data import DEFAULT_VOCAB_SIZE, train_tokenizer
from tests.coverage import Result, causal_lm_types, classify, compare, render, sweep_type
from tests.saved_models import REPO

REFUSAL = (
    "error: model type 'gemma3' has no tensor-parallel plan, and its decoder layers "
    "(one nn.ModuleList) were not found"
)


@pytest.fixture(scope="module")
def entries(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("coverage")
    tokenizer = train_tokenizer(["hello world", "tune"], DEFAULT_VOCAB_SIZE, root / "tokenizer")
    llama_gemma3 = [
        sweep_type(name, root, tokenizer, ("tp1", "tp2")) for name in ("llama", "gemma3")
    ]
    return [*llama_gemma3, sweep_type("doge", root, tokenizer, ("tp1", "tp2", "tp2_sp"))]


def test_llama_trains_at_tp2_as_at_tp1_and_gemma3_image_text_is_refused_at_tp2(entries):
    llama, gemma3, _ = (entry["results"] for entry in entries)
    assert not any(entry["built"] for entry in entries)
    assert llama["tp1"]["status"] == gemma3["tp1"]["status"] == "works"
    assert len(set(llama["tp1"]["losses"])) == len(set(gemma3["tp1"]["losses"])) == 3
    assert llama["tp2"]["status"] == "works"  # within 1e-5 of tp=1 (compare)
    assert llama["tp2"]["losses"] == pytest.approx(llama["tp1"]["losses"], rel=1e-5)
    assert gemma3["tp2"] == {"status": "refused", "line": REFUSAL, "losses": None}
    table = render(
        entries[:2], "python bench/coverage.py --only llama,gemma3", len(causal_lm_types())
    )
    assert "| llama | yes | no | works | works | — | — |  |" in table
    assert f"| gemma3 | text config's | no | works | refused | — | — | tp=2: {REFUSAL} |" in table


def test_doge_trains_at_tp2_and_with_sequence_parallelism_as_at_tp1(entries):
    """Doge's own plan, corrected (dt_proj's per-head outputs, this rank's heads kept), and under
    sequence parallelism its blocks' own residual scales as replicated DTensors."""
    doge = entries[2]["results"]
    assert doge["tp1"]["status"] == "works" and len(set(doge["tp1"]["losses"])) == 3
    for layout in ("tp2", "tp2_sp"):
        assert doge[layout]["status"] == "works", doge[layout]["line"]
        assert doge[layout]["losses"] == pytest.approx(doge["tp1"]["losses"], rel=1e-5)


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
