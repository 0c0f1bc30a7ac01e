"""Read a user's JSONL training data, checking every line up front with errors that point at the
line.

The recipe reads the data before it starts any process, so a typo on line 9000 stops the run at once
with ``data.jsonl line 9000: ...`` instead of in every rank's traceback partway through training.
"""

import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

# "tool": a tool's result, which the model's chat template renders (its tool-calling format)
ROLES = ("system", "user", "assistant", "tool")


class DataError(ValueError):
    """Training data that cannot be used; the message is one line naming the file and line."""


def record_problem(record) -> str | None:
    """What is wrong with one parsed record, or None when it is a usable one."""
    if not isinstance(record, dict):
        return f"expected a JSON object, got {type(record).__name__}"
    if record.get("messages") is not None:  # None: a table's empty cell (data=hf of both kinds)
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            return '"messages" must be a non-empty list of {"role", "content"} objects'
        for index, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("content"), str):
                return f'messages[{index}] needs a "content" string'
            if message.get("role") not in ROLES:
                role = message.get("role")
                return f"messages[{index}] has role {role!r}; use one of {', '.join(ROLES)}"
        if messages[-1]["role"] != "assistant":
            last = messages[-1]["role"]
            return f"the last message must be from the assistant (it is from the {last})"
        if len(messages) < 2:
            return '"messages" needs a user (or system) message before the assistant\'s answer'
        return None
    if isinstance(record.get("prompt"), str) and isinstance(record.get("response"), str):
        return None
    return 'needs "prompt" and "response" strings, or "messages"'


def iter_jsonl(path: str | Path) -> Iterator[dict]:
    """Every record of a JSONL file in order, each checked as it is read: ``{"prompt", "response"}``
    or ``{"messages": [...]}`` objects (a messages record's last message must be the assistant's,
    what is trained on). Blank lines are skipped; a file of none yields nothing
    (:class:`components.data.sources.JsonlSource` says it has no records).

    Raises:
        DataError: At the first bad line (``data.jsonl line 3: not valid JSON (...)``), or if the
            file does not exist.
    """
    return iter_records(path, jsonl_record_problem)


def jsonl_record_problem(record) -> str | None:
    """:func:`record_problem`, and a message's ``tool_calls``, which a JSONL file's records would
    lose (they keep ``role`` and ``content``): refused rather than trained without."""
    if problem := record_problem(record):
        return problem
    for index, message in enumerate(record.get("messages") or []):
        if message.get("tool_calls"):
            return (
                f"messages[{index}] has tool_calls, which data=jsonl does not read yet: write the "
                "call in its content, or read the file with data=hf"
            )
    return None


def iter_records(path: str | Path, problem_of: Callable[[object], str | None]) -> Iterator[dict]:
    """Every record of a JSONL file in order, each parsed and checked by ``problem_of`` (what is
    wrong with it, or None) as it is read; blank lines skipped.

    Raises:
        DataError: At the first bad line, naming it, or if the file does not exist.
    """
    return checked_records(named_lines(path), problem_of)


def checked_records(
    named: Iterable[tuple[str, object]], problem_of: Callable[[object], str | None]
) -> Iterator[dict]:
    """Each record of ``named`` ((where it is, the record): :func:`named_lines`' or a table's
    rows') checked by ``problem_of`` as it is read.

    Raises:
        DataError: At the first bad record, naming where it is (``data.jsonl line 3: ...``).
    """
    for where, record in named:
        if problem := problem_of(record):
            raise DataError(f"{where}: {problem}")
        yield record


def named_lines(path: str | Path) -> Iterator[tuple[str, object]]:
    """Each non-blank line of a JSONL file parsed, with where it is (``data.jsonl line 3``).

    Raises:
        DataError: At the first line that is not UTF-8 or JSON, naming it, or if the file does not
            exist.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file not found: {path}")
    with path.open("rb") as lines:  # bytes, so an encoding error can name its line too
        for number, raw in enumerate(lines, start=1):
            try:
                line = raw.decode("utf-8-sig")  # -sig: a BOM some editors write is not an error
            except UnicodeDecodeError as error:
                raise DataError(f"{path} line {number}: not valid UTF-8 ({error.reason})") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"{path} line {number}: not valid JSON ({error.msg})") from None
            yield f"{path} line {number}", record
