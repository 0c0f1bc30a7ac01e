"""tokenize_example masks the prompt and keeps the answer; tokenize_batch marks a record whose
answer is cut off and record_error names it."""

import pytest

from components.data.collate import IGNORE_INDEX, record_error, tokenize_batch, tokenize_example
from components.data.generated import generate_examples
from components.data.jsonl import DataError
from components.data.tokenizer import DEFAULT_VOCAB_SIZE, train_tokenizer, training_texts


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    texts = training_texts(generate_examples(500, seed=0))
    return train_tokenizer(texts, DEFAULT_VOCAB_SIZE, tmp_path_factory.mktemp("tokenizer"))


def _kept(input_ids, labels):
    return [token for token, label in zip(input_ids, labels, strict=True) if label != IGNORE_INDEX]


def test_prompt_response_masks_the_prompt_and_keeps_response_and_eos(tokenizer):
    input_ids, labels = tokenize_example(
        {"prompt": "Reverse: abc", "response": "cba"},
        tokenizer,
        seq_len=64,
        loss_on="all_assistant",
    )
    assert len(input_ids) == len(labels)
    assert tokenizer.decode(input_ids) == "<|bos|><|user|>Reverse: abc<|assistant|>cba<|eos|>"
    kept = _kept(input_ids, labels)
    assert tokenizer.decode(kept) == "cba<|eos|>" and kept[-1] == tokenizer.eos_token_id
    assert labels[: len(input_ids) - len(kept)] == [IGNORE_INDEX] * (len(input_ids) - len(kept))
    assert labels[-len(kept) :] == input_ids[-len(kept) :]  # aligned with the inputs, not shifted


def test_messages_train_only_the_final_assistant_message(tokenizer):
    record = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Add 1 and 1"},
            {"role": "assistant", "content": "2"},
            {"role": "user", "content": "Uppercase: ab"},
            {"role": "assistant", "content": "AB"},
        ]
    }
    input_ids, labels = tokenize_example(record, tokenizer, seq_len=64, loss_on="last_assistant")
    assert tokenizer.decode(input_ids) == tokenizer.apply_chat_template(
        record["messages"], tokenize=False
    )
    assert tokenizer.decode(_kept(input_ids, labels)) == "AB<|eos|>"


def test_the_prompt_part_ends_with_the_generation_prompt(tokenizer):
    record = {"prompt": "Next letter after c", "response": "d"}
    input_ids, labels = tokenize_example(record, tokenizer, seq_len=64, loss_on="all_assistant")
    masked = input_ids[: labels.count(IGNORE_INDEX)]
    messages = [{"role": "user", "content": record["prompt"]}]
    assert tokenizer.decode(masked) == tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_truncates_to_seq_len(tokenizer):
    full_ids, full_labels = tokenize_example(
        {"prompt": "Repeat twice: abcd", "response": "abcd abcd"}, tokenizer, 64, "all_assistant"
    )
    input_ids, labels = tokenize_example(
        {"prompt": "Repeat twice: abcd", "response": "abcd abcd"}, tokenizer, 8, "all_assistant"
    )
    assert (input_ids, labels) == (full_ids[:8], full_labels[:8])


def test_records_whose_answer_is_cut_off_are_reported(tokenizer):
    records = [
        {"prompt": "Add 2 and 3", "response": "5"},
        {"prompt": "Reverse: " + "abc" * 30, "response": "x"},
    ]
    columns = {
        "prompt": [r["prompt"] for r in records],
        "response": [r["response"] for r in records],
    }
    labelled = tokenize_batch(columns, tokenizer, seq_len=16, loss_on="all_assistant")["labelled"]
    assert labelled[0] > 0 and labelled[1] == 0
    error = record_error(1, records[1], tokenizer, seq_len=16, loss_on="all_assistant")
    assert isinstance(error, DataError)
    assert str(error).startswith("record 2 has no answer tokens within train.seq_len (16)")


def test_a_tokenizer_without_chat_template_is_an_error(tokenizer):
    class NoTemplate:
        chat_template = None

    with pytest.raises(ValueError, match="tokenizer NoTemplate has no chat_template"):
        tokenize_example(
            {"prompt": "p", "response": "r"}, NoTemplate(), seq_len=8, loss_on="all_assistant"
        )
