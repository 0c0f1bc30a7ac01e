"""The coverage table: every causal-LM model type of the pinned transformers, a tiny random model of
each written by ``save_pretrained``, the recipe run on it through the command line at tp=1, tp=2,
tp=2 sp=true and (MoE) tp=2 ep=2, each result works / refused / broken; written to docs/coverage.md.

    python bench/coverage.py [--only llama,qwen2] [--layouts pp2,lora] [--results DIR] [--rerun]
    python bench/coverage.py --import-table docs/coverage.md --measured "2026-12-03" ...
    python bench/coverage.py --results DIR --table-only

Each type's results are cached in ``DIR/TYPE.json`` (a sweep resumes where it stopped; ``--rerun``
runs the named types again); the table is rewritten from every cached type after each one.
``--layouts`` runs those columns alone (and tp=1 and their reference runs, which the comparison
needs), merged into the cached results; ``--import-table`` first caches a page's rows (statuses and
lines, no losses) for types not cached yet, marked as measured at ``--measured``;
``--table-only`` writes the page from the cached results and runs nothing.
"""

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from components.data import DEFAULT_VOCAB_SIZE, train_tokenizer
from tests.coverage import LAYOUTS, causal_lm_types, sweep_type
from tests.coverage_page import entries_from_table, render

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated model types (default: all)")
    parser.add_argument("--results", type=Path, default=Path("/tmp/shardtune-coverage"))
    parser.add_argument("--output", type=Path, default=REPO / "docs" / "coverage.md")
    parser.add_argument("--rerun", action="store_true", help="run cached types again")
    parser.add_argument("--layouts", default="", help="comma-separated columns (default: all)")
    parser.add_argument("--import-table", type=Path, help="a coverage page to start from")
    parser.add_argument("--measured", default="before", help="when the imported page was measured")
    parser.add_argument("--table-only", action="store_true", help="write the page, run nothing")
    arguments = parser.parse_args()
    layouts = arguments.layouts.split(",") if arguments.layouts else list(LAYOUTS)
    if unknown := sorted(set(layouts) - set(LAYOUTS)):
        sys.exit(
            f"error: not columns of the table: {', '.join(unknown)} (known: {', '.join(LAYOUTS)})"
        )
    every = causal_lm_types()
    chosen = arguments.only.split(",") if arguments.only else every
    unknown = sorted(set(chosen) - set(every))
    if unknown:
        sys.exit(f"error: not causal-LM model types of transformers: {', '.join(unknown)}")
    root = arguments.results
    root.mkdir(parents=True, exist_ok=True)
    if arguments.import_table:
        for entry in entries_from_table(arguments.import_table.read_text(), arguments.measured):
            cached = root / f"{entry['type']}.json"
            if not cached.exists():
                cached.write_text(json.dumps(entry, indent=1))
    tokenizer = train_tokenizer(["hello world", "tune"], DEFAULT_VOCAB_SIZE, root / "tokenizer")
    command = " ".join(["python bench/coverage.py", shlex.join(sys.argv[1:])]).strip()
    for model_type in [] if arguments.table_only else chosen:
        cached = root / f"{model_type}.json"
        known = json.loads(cached.read_text()) if cached.exists() else None
        if known and not arguments.rerun and set(layouts) <= set(known.get("measured", {})):
            continue
        if known and known["built"]:
            continue  # no tiny model: no layout runs
        start = time.perf_counter()
        entry = sweep_type(model_type, root, tokenizer, layouts, known)
        cached.write_text(json.dumps(entry, indent=1))
        cells = {layout: fields["status"] for layout, fields in entry["results"].items()}
        print(f"{model_type}: {entry['built'] or cells} ({time.perf_counter() - start:.0f} s)")
        write_table(root, arguments.output, command, len(every))
    write_table(root, arguments.output, command, len(every))


def write_table(root: Path, output: Path, command: str, total: int) -> None:
    """The table of every type cached under ``root``, to ``output``."""
    entries = [json.loads(path.read_text()) for path in sorted(root.glob("*.json"))]
    output.write_text(render(entries, command, total))


if __name__ == "__main__":
    main()
