"""The coverage table: every causal-LM model type of the pinned transformers, a tiny random model of
each written by ``save_pretrained``, the recipe run on it through the command line at tp=1, tp=2,
tp=2 sp=true and (MoE) tp=2 ep=2, each result works / refused / broken; written to docs/coverage.md.

    python bench/coverage.py [--only llama,qwen2] [--results DIR] [--rerun]

Each type's results are cached in ``DIR/TYPE.json`` (a sweep resumes where it stopped; ``--rerun``
runs the named types again); the table is rewritten from every cached type after each one.
"""

import argparse
import datetime
import json
import shlex
import shutil
import sys
import time
import traceback
from pathlib import Path

import transformers

from components.data import DEFAULT_VOCAB_SIZE, train_tokenizer
from tests.coverage import (
    LAYOUTS,
    Result,
    as_json,
    causal_lm_types,
    compare,
    from_json,
    has_plan,
    is_moe,
    run_layout,
    save_tiny_model,
)

REPO = Path(__file__).resolve().parents[1]
HEADINGS = {"tp1": "tp=1", "tp2": "tp=2", "tp2_sp": "tp=2 sp", "tp2_ep2": "tp=2 ep=2"}


def sweep_type(model_type: str, root: Path, tokenizer) -> dict:
    """Build ``model_type``'s tiny model and run every layout that applies to it."""
    entry = {"type": model_type, "plan": has_plan(model_type), "moe": False, "built": ""}
    folder = root / "models" / model_type
    shutil.rmtree(folder, ignore_errors=True)
    try:
        entry["moe"] = is_moe(save_tiny_model(model_type, folder, tokenizer))
    except Exception as error:  # noqa: BLE001 - the table records why a type has no tiny model
        entry["built"] = traceback.format_exception_only(error)[-1].strip().splitlines()[0]
        return entry | {"results": {}}
    results: dict[str, Result] = {}
    for layout in LAYOUTS:
        if layout == "tp2_ep2" and not entry["moe"]:
            continue
        if layout != "tp1" and results["tp1"].status != "works":
            results[layout] = Result("skipped", "tp=1 does not work")
            continue
        output_dir = root / "runs" / model_type / layout
        shutil.rmtree(output_dir, ignore_errors=True)
        result = run_layout(folder, root / "cache", output_dir, layout)
        results[layout] = result if layout == "tp1" else compare(results["tp1"], result)
    shutil.rmtree(root / "runs" / model_type, ignore_errors=True)
    return entry | {"results": as_json(results)}


def _cell(result: Result | None) -> str:
    return "—" if result is None else result.status


def _note(entry: dict) -> str:
    if entry["built"]:
        return f"no tiny model: {entry['built']}"
    results = from_json(entry["results"])
    lines = [
        f"{HEADINGS[layout]}: {result.line}"
        for layout, result in results.items()
        if result.status in ("refused", "broken")
    ]
    unique = list(dict.fromkeys(lines))
    return "; ".join(unique)[:400].replace("|", "\\|").replace("\n", " ")


def _totals(entries: list[dict], plan: bool) -> str:
    group = [entry for entry in entries if entry["plan"] == plan]
    counts: dict[str, int] = {}
    for entry in group:
        status = from_json(entry["results"]).get("tp2", Result("not built")).status
        counts[status] = counts.get(status, 0) + 1
    parts = ", ".join(f"{count} {status}" for status, count in sorted(counts.items()))
    return f"{len(group)} types {'with' if plan else 'without'} a plan, at tp=2: {parts}"


def render(entries: list[dict], command: str, total: int) -> str:
    """The markdown page: how it was made, the totals, one row per type."""
    today = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Model coverage",
        "",
        f"Measured {today} with transformers {transformers.__version__}: `{command}`",
        f"({len(entries)} of the {total} causal-LM model types swept).",
        "",
        "Each type's own config class, shrunk (2 layers, hidden 64, 4 heads, 4 experts, vocabulary",
        "384, dropout off), a random model written by `save_pretrained`, 3 steps of the recipe",
        "(`model=pretrained model.pretrained_path=FOLDER`). **works**: it trains, and at tp=2 its",
        "losses equal tp=1's within 1e-5 (relative); **refused**: one `error:` line, no traceback;",
        "**broken**: a traceback or different losses; **skipped**: tp=1 does not work; —: not MoE.",
        "",
        f"- {_totals(entries, True)}",
        f"- {_totals(entries, False)}",
        "",
        "| type | plan | MoE | tp=1 | tp=2 | tp=2 sp | tp=2 ep=2 | why not |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for entry in entries:
        results = from_json(entry["results"])
        cells = [_cell(results.get(layout)) for layout in HEADINGS]
        if entry["built"]:
            cells = ["not built"] * 4
        flags = ["yes" if entry["plan"] else "no", "yes" if entry["moe"] else "no"]
        lines.append(f"| {entry['type']} | {' | '.join(flags + cells)} | {_note(entry)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated model types (default: all)")
    parser.add_argument("--results", type=Path, default=Path("/tmp/shardtune-coverage"))
    parser.add_argument("--output", type=Path, default=REPO / "docs" / "coverage.md")
    parser.add_argument("--rerun", action="store_true", help="run cached types again")
    arguments = parser.parse_args()
    every = causal_lm_types()
    chosen = arguments.only.split(",") if arguments.only else every
    unknown = sorted(set(chosen) - set(every))
    if unknown:
        sys.exit(f"error: not causal-LM model types of transformers: {', '.join(unknown)}")
    root = arguments.results
    tokenizer = train_tokenizer(["hello world", "tune"], DEFAULT_VOCAB_SIZE, root / "tokenizer")
    command = "python bench/coverage.py " + shlex.join(sys.argv[1:])
    for model_type in chosen:
        cached = root / f"{model_type}.json"
        if cached.exists() and not arguments.rerun:
            continue
        start = time.perf_counter()
        entry = sweep_type(model_type, root, tokenizer)
        cached.write_text(json.dumps(entry, indent=1))
        cells = {layout: fields["status"] for layout, fields in entry["results"].items()}
        print(f"{model_type}: {entry['built'] or cells} ({time.perf_counter() - start:.0f} s)")
        entries = [json.loads(path.read_text()) for path in sorted(root.glob("*.json"))]
        arguments.output.write_text(render(entries, command, len(every)))


if __name__ == "__main__":
    main()
