"""The coverage page (docs/coverage.md) that ``bench/coverage.py`` writes from the sweep's entries
(:func:`tests.coverage.sweep_type`), and reads back (:func:`entries_from_table`) to start a sweep
of new columns from a page. Each refusal is the whole ``error:`` line the run printed: one line
names every problem the checks found, joined by "; ", so a row's notes are joined by
:data:`NOTES_SEPARATOR`, which no line holds.
"""

import datetime
import re

import transformers

from tests.coverage import (
    LAYOUTS,
    STOCHASTIC,
    TIES,
    TIMEOUTS,
    WHOLE_BATCH,
    Result,
    from_json,
    has_plan,
)

NOTES_SEPARATOR = "<br>"  # a line break in the table's cell


HEADINGS = {"tp1": "tp=1", "tp2": "tp=2", "tp2_sp": "tp=2 sp", "tp2_ep2": "tp=2 ep=2"}
HEADINGS |= {"pp2": "pp=2", "cp2": "cp=2", "lora": "LoRA tp=2", "fp8": "fp8"}
HEADINGS_OF_RUNS = HEADINGS | {"lora_tp1": "LoRA tp=1"}  # the notes name the reference runs too


def _cell(result: Result | None) -> str:
    return "—" if result is None else result.status


def _note(entry: dict) -> str:
    """Each refusal or failure line once, after the layouts that gave it; run folders as FOLDER."""
    if entry["built"]:
        return _cell_text(f"no tiny model: {entry['built']}")
    layouts: dict[str, list[str]] = {}
    results = from_json(entry["results"])
    for layout in [name for name in LAYOUTS if name in results]:  # a reference before its column
        result = results[layout]
        if result.status in ("refused", "broken"):
            layouts.setdefault(result.line, []).append(HEADINGS_OF_RUNS[layout])
    notes = [f"{', '.join(names)}: {line}" for line, names in layouts.items()]
    if entry["type"] in STOCHASTIC:
        notes.append(f"every layout with train.packing=true: {STOCHASTIC[entry['type']]}")
    if entry["type"] in TIMEOUTS:
        seconds, why = TIMEOUTS[entry["type"]]
        notes.append(f"each run given {seconds} s: {why}")
    if entry["type"] in TIES:
        whole = " ".join(WHOLE_BATCH)
        notes.append(f"tp=1 against its own loss with {whole}: {TIES[entry['type']]}")
    return NOTES_SEPARATOR.join(_cell_text(note) for note in notes)


def _cell_text(text: str) -> str:
    """``text`` whole, as a table cell: run folders as FOLDER, pipes escaped, on one line."""
    text = re.sub(r"/\S*/models/[\w.-]+", "FOLDER", text)
    return text.replace("|", "\\|").replace("`", "'").replace("\n", " ")


def _totals(entries: list[dict], plan: bool) -> str:
    group = [entry for entry in entries if (has_plan(entry["type"]) == "own") == plan]
    counts: dict[str, int] = {}
    for entry in group:
        status = from_json(entry["results"]).get("tp2", Result("not built")).status
        counts[status] = counts.get(status, 0) + 1
    parts = ", ".join(f"{count} {status}" for status, count in sorted(counts.items()))
    kind = "with a plan of their own" if plan else "without (or with only a text config's)"
    broken = [e for e in group if any(r["status"] == "broken" for r in e["results"].values())]
    return f"{len(group)} types {kind}, at tp=2: {parts}; broken at some layout: {len(broken)}"


def entries_from_table(text: str, measured: str) -> list[dict]:
    """The entries of a coverage page ``text`` written by :func:`render` (its statuses and
    refusal lines, no losses), each layout marked ``measured`` at that time: what a sweep of new
    columns starts from when the earlier results are not cached here."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| type |"))
    headings = [cell.strip() for cell in lines[start].strip("|").split("|")][3:-1]
    layouts = {heading: layout for layout, heading in HEADINGS_OF_RUNS.items()}
    entries = []
    for row in lines[start + 2 :]:
        if not row.startswith("| "):
            break
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", row.strip()[1:-1])]
        name, _, moe, *statuses, note = cells
        entry = {"type": name, "plan": has_plan(name), "moe": moe == "yes", "built": ""}
        if statuses[0] == "not built":
            entry["built"] = note.removeprefix("no tiny model: ")
            entries.append(entry | {"results": {}})
            continue
        said = _notes_by_heading(note)
        results = {
            layouts[heading]: {"status": status, "line": said.get(heading, ""), "losses": None}
            for heading, status in zip(headings, statuses, strict=True)
            if status != "—"
        }
        results |= _reference_runs(said, results, layouts)
        ran = [layout for layout, result in results.items() if result["status"] != "skipped"]
        entries.append(entry | {"results": results, "measured": dict.fromkeys(ran, measured)})
    return entries


def _reference_runs(said: dict[str, str], results: dict, layouts: dict[str, str]) -> dict:
    """The runs a row's notes name that are no column (LoRA tp=1, the LoRA column's reference),
    each with the status of the column that shares its line."""
    found = {}
    for heading, line in said.items():
        if layouts[heading] not in results:
            shared = [result["status"] for result in results.values() if result["line"] == line]
            status = shared[0] if shared else "refused"
            found[layouts[heading]] = {"status": status, "line": line, "losses": None}
    return found


def _notes_by_heading(note: str) -> dict[str, str]:
    """A row's notes (``tp=2, tp=2 sp: error: ...<br>pp=2: error: ...``) as heading -> line."""
    said = {}
    for part in note.split(NOTES_SEPARATOR):
        names, _, line = part.partition(": ")
        headings = names.split(", ")
        if all(heading in HEADINGS_OF_RUNS.values() for heading in headings):
            said |= dict.fromkeys(headings, line.replace("\\|", "|"))
    return said


def _measured(entries: list[dict]) -> list[str]:
    """When each column was measured: the first and last time over the types that ran it (a time
    imported from a page may be that page's range, ``FIRST to LAST``), how many ran it and how
    many were skipped (tp=1, or LoRA tp=1, does not work)."""
    lines = ["When each column was measured (the first and the last type's run):", ""]
    for layout, heading in HEADINGS.items():
        ran = [e["measured"][layout] for e in entries if layout in e.get("measured", {})]
        times = sorted(time for span in ran for time in span.split(" to "))
        statuses = [e["results"].get(layout, {}).get("status") for e in entries]
        skipped = f", {statuses.count('skipped')} skipped" if "skipped" in statuses else ""
        if times:
            lines.append(f"- {heading}: {times[0]} to {times[-1]} ({len(ran)} types{skipped})")
    return lines


def render(entries: list[dict], command: str, total: int) -> str:
    """The markdown page: how it was made, the totals, one row per type."""
    today = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Model coverage",
        "",
        f"Measured {today} with transformers {transformers.__version__}: `{command}`",
        f"({len(entries)} of the {total} causal-LM model types swept; each type's results are",
        "cached from its last run, and `--rerun --only TYPE` runs it again).",
        "",
        "Each type's own config class, shrunk (2 layers, hidden 64, 4 heads, 4 experts, vocabulary",
        "384, dropout off), a random model written by `save_pretrained`, 3 steps of the recipe",
        "(`model=pretrained model.pretrained_path=FOLDER`). **works**: it trains, and at tp=2 its",
        "losses equal tp=1's within 1e-5 (relative); **refused**: one `error:` line, no traceback;",
        "**broken**: a traceback or different losses (or tp=1's first loss not the causal-LM",
        "loss of the Hugging Face model's own logits on the same batch); **skipped**: its",
        "reference (tp=1; LoRA tp=1 for LoRA tp=2) does not work and the layout is not refused,",
        "so nothing can say whether it trains the right model; —: not MoE",
        "(tp=2 ep=2) or not run. The layouts that can be silently wrong: pp=2 and cp=2 against",
        "tp=1 within 1e-5; LoRA tp=2 is `peft=lora` on every linear of the model (`lm_head`",
        "among them) at tp=2 against the same at tp=1 within 1e-5, whose first loss is",
        "tp=1's (every B starts at zero); fp8 is `train.precision=fp8` at tp=1 within 2e-2 of",
        "tp=1's losses. **why not**: the whole `error:` line each run printed, after the runs that",
        "printed it, a line each; one `error:` line names every problem the checks found, joined",
        'by "; ".',
        "",
        f"- {_totals(entries, True)}",
        f"- {_totals(entries, False)}",
        "",
        *_measured(entries),
        "",
        f"| type | plan | MoE | {' | '.join(HEADINGS.values())} | why not |",
        "|---|---|---|" + "---|" * len(HEADINGS) + "---|",
    ]
    for entry in entries:
        results = from_json(entry["results"])
        cells = [_cell(results.get(layout)) for layout in HEADINGS]
        if entry["built"]:
            cells = ["not built"] * len(HEADINGS)
        plan = {"own": "yes", "text": "text config's", "": "no"}[has_plan(entry["type"])]
        flags = [plan, "yes" if entry["moe"] else "no"]
        lines.append(f"| {entry['type']} | {' | '.join(flags + cells)} | {_note(entry)} |")
    return "\n".join(lines) + "\n"
