"""generate_examples: deterministic, short, and answers that follow from their prompts."""

import pytest

from components.data.generated import LETTERS, generate_examples


def test_same_n_and_seed_give_the_same_list_and_other_seeds_differ():
    assert generate_examples(200, seed=3) == generate_examples(200, seed=3)
    assert generate_examples(200, seed=3) != generate_examples(200, seed=4)
    assert (
        generate_examples(50, seed=3) == generate_examples(200, seed=3)[:50]
    )  # a longer run extends it


def test_records_are_short_prompt_response_strings_covering_every_task():
    records = generate_examples(300, seed=0)
    assert all(set(record) == {"prompt", "response"} for record in records)
    assert all(len(record["prompt"]) + len(record["response"]) < 40 for record in records)
    tasks = {record["prompt"].split(" ")[0] for record in records}
    assert tasks == {"Reverse:", "Uppercase:", "Repeat", "Next", "Add", "Sort:"}


def _expected(prompt: str) -> str:
    if prompt.startswith("Reverse: "):
        return prompt.removeprefix("Reverse: ")[::-1]
    if prompt.startswith("Uppercase: "):
        return prompt.removeprefix("Uppercase: ").upper()
    if prompt.startswith("Repeat twice: "):
        word = prompt.removeprefix("Repeat twice: ")
        return f"{word} {word}"
    if prompt.startswith("Next letter after "):
        return LETTERS[LETTERS.index(prompt[-1]) + 1]
    if prompt.startswith("Add "):
        _, a, _, b = prompt.split(" ")
        return str(int(a) + int(b))
    return " ".join(sorted(prompt.removeprefix("Sort: ").split(" ")))


def test_every_response_is_the_rule_applied_to_its_prompt():
    for record in generate_examples(500, seed=1):
        assert record["response"] == _expected(record["prompt"]), record


def test_negative_n_is_an_error():
    with pytest.raises(ValueError, match="number of generated examples must be >= 0, got -1"):
        generate_examples(-1, seed=0)
