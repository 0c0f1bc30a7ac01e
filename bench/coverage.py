"""The coverage table: every causal-LM model type of the pinned transformers, a tiny random model of
each written by ``save_pretrained``, the recipe run on it through the command line at tp=1, tp=2,
tp=2 sp=true and (MoE) tp=2 ep=2, each result works / refused / broken; written to docs/coverage.md.

    python bench/coverage.py [--only llama,qwen2] [--results DIR] [--rerun]

Each type's results are cached in ``DIR/TYPE.json`` (a sweep resumes where it stopped; ``--rerun``
runs the named types again); the table is rewritten from every cached type after each one.
"""

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from components.data import DEFAULT_VOCAB_SIZE, train_tokenizer
from tests.coverage import causal_lm_types, render, sweep_type

REPO = Path(__file__).resolve().parents[1]


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
    command = " ".join(["python bench/coverage.py", shlex.join(sys.argv[1:])]).strip()
    for model_type in chosen:
        cached = root / f"{model_type}.json"
        if cached.exists() and not arguments.rerun:
            continue
        start = time.perf_counter()
        entry = sweep_type(model_type, root, tokenizer)
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
