"""data.loss_on=all_assistant labels every assistant message's content and its closing token, and
nothing else, under the chat templates of Llama 3, Qwen3, SmolLM2 and Gemma (their Jinja text in
templates/, on a tiny byte-level BPE with each family's special tokens); a template that cannot be
split turn by turn is one error naming the record."""

import json
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from components.data.collate import IGNORE_INDEX, record_error, tokenize_batch, tokenize_example
from components.data.sources import HFSource

TEMPLATES = Path(__file__).parent / "templates"
# family: (special tokens, added non-special tokens, bos, eos, the token closing an assistant turn)
FAMILIES = {
    "llama3": (
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        [],
        "<|begin_of_text|>",
        "<|eot_id|>",
        "<|eot_id|>",
    ),
    "qwen3": (
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        [
            "<think>",
            "</think>",
            "<tool_call>",
            "</tool_call>",
            "<tool_response>",
            "</tool_response>",
        ],
        None,
        "<|im_end|>",
        "<|im_end|>",
    ),
    "smollm2": (
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        [],
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
    ),
    "gemma": (
        ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"],
        [],
        "<bos>",
        "<eos>",
        "<end_of_turn>",
    ),
}
ANSWERS = ["Paris is the capital.", "About two million people live there.", "Yes, the Louvre."]
CONVERSATION = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": ANSWERS[0]},
    {"role": "user", "content": "How many people live there?"},
    {"role": "assistant", "content": ANSWERS[1]},
    {"role": "user", "content": "Is there a museum?"},
    {"role": "assistant", "content": ANSWERS[2]},
]


def family_tokenizer(family: str, template: str | None = None) -> PreTrainedTokenizerFast:
    specials, added, bos, eos, _ = FAMILIES[family]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [message["content"] for message in CONVERSATION] * 4
    backend.train_from_iterator(texts, trainer)
    backend.add_tokens([AddedToken(token, special=False) for token in added])
    chat_template = template or (TEMPLATES / f"{family}.jinja").read_text().rstrip("\n")
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=eos,
        pad_token=specials[0],
        chat_template=chat_template,
    )


def reference_labels(messages: list[dict], tokenizer, closing: str) -> tuple[list, list]:
    """The conversation's ids, and labels built turn by turn from apply_chat_template: each
    assistant content's ids (where they follow its turn's prompt) and the closing token after
    them."""
    render = tokenizer.apply_chat_template
    full = tokenizer.encode(render(messages, tokenize=False), add_special_tokens=False)
    labels = [IGNORE_INDEX] * len(full)
    closing_id = tokenizer.convert_tokens_to_ids(closing)
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(messages[:index], tokenize=False, add_generation_prompt=True)
        start = len(tokenizer.encode(prompt, add_special_tokens=False))
        content = tokenizer.encode(message["content"], add_special_tokens=False)
        at = next(i for i in range(start, len(full)) if full[i : i + len(content)] == content)
        end = at + len(content)
        assert full[end] == closing_id
        labels[at : end + 1] = full[at : end + 1]
    labels[0] = IGNORE_INDEX
    return full, labels


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_assistant_turn_is_labelled_with_its_closing_token(family):
    tokenizer = family_tokenizer(family)
    closing = FAMILIES[family][4]
    columns = {"messages": [CONVERSATION]}
    tokenized = tokenize_batch(columns, tokenizer, seq_len=512, loss_on="all_assistant")
    expected_ids, expected_labels = reference_labels(CONVERSATION, tokenizer, closing)
    assert tokenized["input_ids"][0] == expected_ids
    assert tokenized["labels"][0] == expected_labels
    kept = [label for label in tokenized["labels"][0] if label != IGNORE_INDEX]
    closing_id = tokenizer.convert_tokens_to_ids(closing)
    pieces = [tokenizer.encode(a, add_special_tokens=False) + [closing_id] for a in ANSWERS]
    assert kept == [token for piece in pieces for token in piece]
    assert tokenized["labelled"][0] == len(kept)


def test_last_assistant_labels_only_the_final_answer_as_before():
    tokenizer = family_tokenizer("smollm2")
    ids, labels = tokenize_example(
        {"messages": CONVERSATION}, tokenizer, seq_len=512, loss_on="last_assistant"
    )
    prompt = tokenizer.apply_chat_template(
        CONVERSATION[:-1], tokenize=False, add_generation_prompt=True
    )
    masked = len(tokenizer.encode(prompt, add_special_tokens=False))
    assert labels[:masked] == [IGNORE_INDEX] * masked and labels[masked:] == ids[masked:]
    assert tokenizer.decode(ids[masked:]) == ANSWERS[2] + "<|im_end|>\n"


def test_tool_results_pass_through_the_template_and_are_not_labelled():
    tokenizer = family_tokenizer("qwen3")
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "Let me look it up."},
        {"role": "tool", "content": "sunny, 21 degrees"},
        {"role": "assistant", "content": "It is sunny."},
    ]
    ids, labels = tokenize_example({"messages": messages}, tokenizer, 512, "all_assistant")
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert "<tool_response>\nsunny, 21 degrees\n</tool_response>" in rendered
    assert tokenizer.decode(ids) == rendered
    kept = tokenizer.decode([label for label in labels if label != IGNORE_INDEX])
    assert kept == "Let me look it up.<|im_end|>It is sunny.<|im_end|>"


def test_a_template_that_rewrites_earlier_turns_is_one_error_naming_the_record():
    # the number of messages first: every prefix renders another first line than the whole
    template = (
        "{{ messages | length }}\n{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tokenizer = family_tokenizer("smollm2", template)
    good = {"messages": CONVERSATION[:2]}
    records = [good, {"messages": CONVERSATION}]
    columns = {"messages": [record["messages"] for record in records]}
    labelled = tokenize_batch(columns, tokenizer, seq_len=512, loss_on="all_assistant")["labelled"]
    assert labelled == [-1, -1]
    error = str(record_error(1, records[1], tokenizer, 512, "all_assistant"))
    assert error.startswith("record 2: the chat template cannot be split turn by turn: ")
    assert "assistant message 2" in error and "\n" not in error


def test_a_tool_call_read_by_data_hf_passes_through_the_template_and_is_trained(tmp_path):
    call = {"type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."},
    ]
    (tmp_path / "calls.jsonl").write_text(json.dumps({"messages": messages}) + "\n")
    where = dict(split="train", name=None, columns=None, num_examples=None, val_fraction=0.0)
    records = HFSource(path=str(tmp_path / "calls.jsonl"), **where).load(tmp_path / "cache")
    tokenizer = family_tokenizer("qwen3")
    tokenized = tokenize_batch(records[:1], tokenizer, seq_len=512, loss_on="all_assistant")
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert tokenizer.decode(tokenized["input_ids"][0]) == rendered
    kept = [label for label in tokenized["labels"][0] if label != IGNORE_INDEX]
    assert tokenizer.decode(kept) == (
        '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
        "Sunny.<|im_end|>"
    )
