"""train_tokenizer: deterministic byte-level BPE, saved and loaded back through AutoTokenizer, with
a chat template."""

import pytest
from transformers import AutoTokenizer

from components.data.generated import generate_examples
from components.data.tokenizer import (
    DEFAULT_VOCAB_SIZE,
    MAX_CHARS_PER_TEXT,
    MAX_TRAINING_CHARS,
    SPECIAL_TOKENS,
    capped_texts,
    train_tokenizer,
    training_texts,
)

TEXTS = training_texts(generate_examples(1000, seed=0))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_tokenizer(TEXTS, DEFAULT_VOCAB_SIZE, tmp_path_factory.mktemp("tokenizer"))


def test_default_vocab_size_divides_by_four_and_bounds_the_length(tokenizer):
    assert DEFAULT_VOCAB_SIZE % 4 == 0
    assert len(tokenizer) <= DEFAULT_VOCAB_SIZE


def test_special_tokens_have_fixed_ids(tokenizer):
    assert [tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)


def test_same_texts_give_the_same_vocabulary(tokenizer, tmp_path):
    again = train_tokenizer(TEXTS, DEFAULT_VOCAB_SIZE, tmp_path)
    assert again.get_vocab() == tokenizer.get_vocab()
    assert again.backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()


def test_round_trip_through_auto_tokenizer(tokenizer, tmp_path):
    saved = train_tokenizer(TEXTS, DEFAULT_VOCAB_SIZE, tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.get_vocab() == saved.get_vocab() and loaded.chat_template == saved.chat_template
    assert (loaded.pad_token, loaded.bos_token, loaded.eos_token) == (
        "<|pad|>",
        "<|bos|>",
        "<|eos|>",
    )
    text = "Reverse: abc"
    assert loaded.encode(text, add_special_tokens=False) == saved.encode(
        text, add_special_tokens=False
    )


@pytest.mark.parametrize("text", ["Reverse: abc", "Sort: c a b", "Ünïcode never seen: 日本 ✓", ""])
def test_encode_decode_is_lossless_and_adds_nothing(tokenizer, text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert all(i >= len(SPECIAL_TOKENS) for i in ids)  # no bos/eos added implicitly


def test_special_tokens_in_text_are_single_tokens(tokenizer):
    ids = tokenizer.encode("<|user|>hi<|assistant|>", add_special_tokens=False)
    assert ids[0] == 3 and ids[-1] == 4
    assert tokenizer.decode(ids, skip_special_tokens=True) == "hi"


def test_chat_template_renders_turns_and_the_generation_prompt(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Add 2 and 3"},
        {"role": "assistant", "content": "5"},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered == "<|bos|>Be brief.\n<|user|>Add 2 and 3<|assistant|>5<|eos|>"
    prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|bos|>Be brief.\n<|user|>Add 2 and 3<|assistant|>"


def test_chat_template_rejects_unknown_roles(tokenizer):
    with pytest.raises(Exception, match="unknown chat role tool; use system, user or assistant"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_too_small_vocab_size_says_the_minimum(tmp_path):
    with pytest.raises(ValueError, match=r"tokenizer vocab_size \(200\) must be at least 261"):
        train_tokenizer(TEXTS, 200, tmp_path)


def test_small_texts_give_fewer_tokens_than_vocab_size(tmp_path):
    assert 261 <= len(train_tokenizer(["ab ab"], DEFAULT_VOCAB_SIZE, tmp_path)) < DEFAULT_VOCAB_SIZE


def test_training_text_is_capped_lazily_in_total_and_per_text():
    consumed = []

    def texts():
        for index in range(10_000):
            consumed.append(index)
            yield "ab " * 5_000  # 15,000 characters each

    capped = list(capped_texts(texts(), max_chars=100_000, per_text=4_000))
    assert [len(text) for text in capped] == [4_000] * 25
    assert len(consumed) == 25  # the rest of the source was never read


def test_one_ten_megabyte_line_trains_on_a_bounded_text(tmp_path):
    line = ("thequickbrownfoxjumpsoverlazydg" * 400_000)[
        :10_000_000
    ]  # one 10 MB "word": no space to split at
    assert (
        sum(len(text) for text in capped_texts([line])) == MAX_CHARS_PER_TEXT <= MAX_TRAINING_CHARS
    )
    tokenizer = train_tokenizer([line], DEFAULT_VOCAB_SIZE, tmp_path)
    assert tokenizer.decode(tokenizer.encode(line[:500])) == line[:500]
