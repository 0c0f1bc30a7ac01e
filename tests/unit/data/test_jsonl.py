"""iter_jsonl: both record shapes, blank lines skipped, and one-line errors naming the file and
line; a file without records is refused by JsonlSource.load, which reads it."""

import json
import re

import pytest

from components.data.jsonl import DataError, iter_jsonl
from components.data.sources import JsonlSource

GOOD = [
    {"prompt": "Add 2 and 3", "response": "5"},
    {
        "messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "a"},
        ]
    },
]


def _write(tmp_path, lines: list[str]):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _error(tmp_path, lines: list[str]) -> str:
    path = _write(tmp_path, lines)
    with pytest.raises(DataError) as caught:
        list(iter_jsonl(path))
    message = str(caught.value)
    assert "\n" not in message
    return message.removeprefix(f"{path} ")


def test_reads_both_shapes_and_skips_blank_lines(tmp_path):
    path = _write(tmp_path, [json.dumps(GOOD[0]), "", "   ", json.dumps(GOOD[1])])
    assert list(iter_jsonl(path)) == GOOD
    assert list(iter_jsonl(str(path))) == GOOD


def test_data_error_is_a_value_error():
    assert issubclass(DataError, ValueError)


def test_invalid_json(tmp_path):
    lines = [json.dumps(GOOD[0]), "", '{"prompt": "a" "response": "b"}']
    assert _error(tmp_path, lines) == "line 3: not valid JSON (Expecting ',' delimiter)"


def test_missing_keys(tmp_path):
    lines = [json.dumps(GOOD[0])] * 4 + [json.dumps({"prompt": "only a prompt"})]
    assert _error(tmp_path, lines) == 'line 5: needs "prompt" and "response" strings, or "messages"'


def test_tool_calls_are_refused_rather_than_dropped(tmp_path):
    call = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."},
    ]
    assert _error(tmp_path, [json.dumps({"messages": messages})]) == (
        "line 1: messages[1] has tool_calls, which data=jsonl does not read yet: write the call "
        "in its content, or read the file with data=hf"
    )


def test_wrong_types(tmp_path):
    assert _error(tmp_path, [json.dumps({"prompt": "p", "response": 5})]) == (
        'line 1: needs "prompt" and "response" strings, or "messages"'
    )
    assert _error(tmp_path, ["[1, 2]"]) == "line 1: expected a JSON object, got list"
    assert _error(tmp_path, [json.dumps({"messages": "hi"})]) == (
        'line 1: "messages" must be a non-empty list of {"role", "content"} objects'
    )
    bad_content = {
        "messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "a"}]
    }
    assert (
        _error(tmp_path, [json.dumps(bad_content)])
        == 'line 1: messages[0] needs a "content" string'
    )
    bad_role = {
        "messages": [{"role": "human", "content": "u"}, {"role": "assistant", "content": "a"}]
    }
    assert _error(tmp_path, [json.dumps(bad_role)]) == (
        "line 1: messages[0] has role 'human'; use one of system, user, assistant, tool"
    )


def test_messages_must_end_with_the_assistant(tmp_path):
    record = {
        "messages": [
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "a"},
            {"role": "user", "content": "u2"},
        ]
    }
    lines = [json.dumps(GOOD[1]), json.dumps(record)]
    assert (
        _error(tmp_path, lines)
        == "line 2: the last message must be from the assistant (it is from the user)"
    )


def test_messages_need_a_prompt_before_the_answer(tmp_path):
    lines = [json.dumps({"messages": [{"role": "assistant", "content": "a"}]})]
    assert (
        _error(tmp_path, lines)
        == 'line 1: "messages" needs a user (or system) message before the assistant\'s answer'
    )


def test_invalid_utf8_names_its_line(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(json.dumps(GOOD[0]).encode() + b"\n" + b'{"prompt": "\xff"}\n')
    with pytest.raises(
        DataError, match=r"^.*data\.jsonl line 2: not valid UTF-8 \(invalid start byte\)$"
    ):
        list(iter_jsonl(path))


def test_a_byte_order_mark_is_accepted(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(GOOD[0]).encode() + b"\n")
    assert list(iter_jsonl(path)) == [GOOD[0]]


@pytest.mark.parametrize("lines", [[], ["", "  "]])
def test_a_file_without_records(tmp_path, lines):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines), encoding="utf-8")
    assert list(iter_jsonl(path)) == []
    with pytest.raises(
        DataError,
        match=f"^{re.escape(str(path))} has no records: expected one JSON object per line$",
    ):
        JsonlSource(path=str(path), num_examples=None, val_fraction=0.0).load(tmp_path / "cache")


def test_missing_file(tmp_path):
    path = tmp_path / "nope.jsonl"
    with pytest.raises(DataError, match=f"^data file not found: {re.escape(str(path))}$"):
        list(iter_jsonl(path))
