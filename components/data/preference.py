"""Preference records for DPO: a prompt with a chosen and a rejected answer, each answer made the
conversation ``finetune.py`` would train on, so its labelled tokens are the ones SFT labels (the
answer's content and the template's closing).

A record is ``{"prompt", "chosen", "rejected"}`` strings, or ``{"chosen": [messages],
"rejected": [messages]}`` whose last turns are the assistant's answers after the same messages
(TRL's "implicit prompt"), or ``{"prompt": [messages], "chosen": [assistant message],
"rejected": [assistant message]}`` (TRL's conversational form). Each record becomes two
conversations, chosen first: :func:`pair_conversations`. The embedded set (:func:`iter_pairs`)
asks the generated set's questions with their right answer chosen and another question's answer
rejected, so a run needs no download.

Docs: docs/dpo.md
"""

from collections.abc import Iterable, Iterator
from pathlib import Path

from components.data import generated
from components.data.jsonl import ROLES, checked_records, named_lines

ANSWERS = ("chosen", "rejected")


def _message_problem(messages, name: str) -> str | None:
    """What is wrong with a list of ``{"role", "content"}`` messages, or None."""
    if not isinstance(messages, list) or not messages:
        return f'"{name}" must be a string or a non-empty list of {{"role", "content"}} objects'
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            return f'{name}[{index}] needs a "content" string'
        if message.get("role") not in ROLES:
            return (
                f"{name}[{index}] has role {message.get('role')!r}; use one of {', '.join(ROLES)}"
            )
    return None


def preference_problem(record) -> str | None:
    """What is wrong with one parsed preference record, or None when it is a usable one."""
    if not isinstance(record, dict):
        return f"expected a JSON object, got {type(record).__name__}"
    missing = [name for name in ANSWERS if name not in record]
    if missing:
        given = ", ".join(sorted(map(repr, record))) or "none"
        return (
            f'a preference record needs "chosen" and "rejected" (missing {" and ".join(missing)}; '
            f"its keys: {given})"
        )
    for name in ("prompt", *ANSWERS):
        value = record.get(name)
        if value is None and name == "prompt":
            continue
        if not isinstance(value, str) and (problem := _message_problem(value, name)):
            return problem
    try:
        chosen, rejected = pair_conversations(record)
    except ValueError as error:
        return str(error)
    if chosen[:-1] != rejected[:-1]:
        return '"chosen" and "rejected" must answer the same messages (all but their last differ)'
    if chosen[-1]["role"] != "assistant" or rejected[-1]["role"] != "assistant":
        return '"chosen" and "rejected" must each end with the assistant\'s answer'
    if len(chosen) < 2:
        return 'a preference record needs a prompt: "prompt", or messages before the answers'
    if chosen[-1] == rejected[-1]:  # the loss would sit at log 2 with no gradient from it
        return '"chosen" and "rejected" are the same answer: a pair prefers one of two answers'
    return None


def _turns(value, role: str) -> list[dict]:
    return [{"role": role, "content": value}] if isinstance(value, str) else list(value)


def pair_conversations(record: dict) -> tuple[list[dict], list[dict]]:
    """The (chosen, rejected) conversations of a record: the prompt's messages (a string prompt is
    one user turn), then each answer (a string answer is one assistant turn).

    Raises:
        ValueError: If ``prompt`` is absent and an answer is a string (nothing to answer).
    """
    prompt = record.get("prompt")
    if prompt is None and any(isinstance(record[name], str) for name in ANSWERS):
        raise ValueError('string "chosen" and "rejected" answers need a "prompt"')
    asked = [] if prompt is None else _turns(prompt, "user")
    chosen, rejected = (asked + _turns(record[name], "assistant") for name in ANSWERS)
    return _plain(chosen), _plain(rejected)


def _plain(messages: list[dict]) -> list[dict]:
    return [{"role": message["role"], "content": message["content"]} for message in messages]


def iter_preference_jsonl(path: str | Path) -> Iterator[dict]:
    """Every record of a JSONL file as two ``{"messages"}`` conversations, chosen then rejected,
    each line checked as read.

    Raises:
        DataError: At the first bad line, naming it (``data.jsonl line 3: a preference record
            needs "chosen" and "rejected" (...)``).
    """
    return _checked_pairs(named_lines(path))


def iter_preference_records(records: Iterable[dict], where: str) -> Iterator[dict]:
    """Every record of a ``datasets`` split as two ``{"messages"}`` conversations, chosen then
    rejected, each checked as read; a column that is None in a record (``datasets`` merges the
    columns of records that differ) is absent from it.

    Raises:
        DataError: At the first bad record, naming it 1-based (``pairs.parquet record 3: ...``).
    """
    named = (
        (f"{where} record {number}", _given(record))
        for number, record in enumerate(records, start=1)
    )
    return _checked_pairs(named)


def _given(record: dict) -> dict:
    """``record`` without its None columns: ``datasets`` gives None for a column a record lacks."""
    return {name: value for name, value in record.items() if value is not None}


def _checked_pairs(named: Iterable[tuple[str, object]]) -> Iterator[dict]:
    """Each record of ``named`` ((where it is, the record): a file's lines, a split's rows)
    checked as read (:func:`preference_problem`), then its two conversations, chosen first."""
    for record in checked_records(named, preference_problem):
        for messages in pair_conversations(record):
            yield {"messages": messages}


def _wrong_answer(right: str, other: str) -> str:
    """Another question's answer, or the right one doubled where they happen to agree."""
    return other if other != right else f"{right} {right}"


def iter_pairs(n: int, seed: int) -> Iterator[dict]:
    """``n`` embedded ``{"prompt", "chosen", "rejected"}`` records: a generated question, its
    right answer chosen, another question's answer rejected; same (n, seed), same records."""
    records = generated.iter_examples(n + 1, seed)
    current = next(records)
    for following in records:
        chosen = current["response"]
        yield {
            "prompt": current["prompt"],
            "chosen": chosen,
            "rejected": _wrong_answer(chosen, following["response"]),
        }
        current = following


def iter_pair_conversations(n: int, seed: int) -> Iterator[dict]:
    """The embedded records (:func:`iter_pairs`) as conversations, chosen then rejected."""
    for record in iter_pairs(n, seed):
        for messages in pair_conversations(record):
            yield {"messages": messages}
