"""Turn records into (input_ids, labels) with only the answers labelled.

Labels are aligned with ``input_ids`` (not shifted): ``cross_entropy_sum`` shifts them itself.
``data.loss_on`` says which answers: ``all_assistant`` labels the content of every assistant
message and what the template closes it with (its first special token after the content), and
nothing else, rendering the conversation turn by turn (a template that rewrites earlier turns is
refused, naming the record); ``last_assistant`` labels everything the template writes after the
final assistant message's prompt. :func:`components.data.loader.collate_rows` lays them into
batches, padded on the right. :func:`tokenize_batch` is the same work in the shape
``datasets.Dataset.map(batched=True)`` wants: it marks a bad record instead of raising, and
:func:`record_error` says afterwards what is wrong with the first one.

Design notes: docs/design-notes.md
"""

from dataclasses import dataclass
from typing import Any

from components.data.jsonl import DataError, record_problem

IGNORE_INDEX = -100
# ``labelled`` of a record that cannot be used at all (malformed, or the template cannot split it).
UNUSABLE = -1


@dataclass(frozen=True, kw_only=True)
class Labelling:
    """How records become examples: the tokenizer (with its chat template), the length they are cut
    to, and which assistant turns are labelled (``all_assistant`` or ``last_assistant``)."""

    tokenizer: Any
    seq_len: int
    loss_on: str


def _messages(record: dict) -> list[dict]:
    if record.get("messages") is not None:
        return record["messages"]
    return [
        {"role": "user", "content": record["prompt"]},
        {"role": "assistant", "content": record["response"]},
    ]


def check_template(tokenizer) -> None:
    """Raise ValueError (one line) if the tokenizer has no chat template to render records with."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"tokenizer {type(tokenizer).__name__} has no chat_template: use one that has (a "
            "chat/instruct "
            "model's, or components.data.tokenizer.train_tokenizer's)"
        )


def render(record: dict, tokenizer) -> tuple[str, str]:
    """(prompt text, answer text) of a record by the tokenizer's chat template: the prompt is
    everything rendered before the final assistant message's content.

    Raises:
        ValueError: If the record has no message before its final assistant message, or the
            template's rendering of the conversation does not start with its rendering of the
            prompt.
    """
    messages = _messages(record)
    if len(messages) < 2 or messages[-1]["role"] != "assistant":
        raise ValueError(
            "a messages record needs at least one message before a final assistant message"
        )
    prompt = tokenizer.apply_chat_template(
        messages[:-1], tokenize=False, add_generation_prompt=True
    )
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    if not full.startswith(prompt):
        raise ValueError(
            "the tokenizer's chat template renders the conversation without its prompt as a "
            "prefix, so the "
            f"answer cannot be separated: prompt {prompt[-60:]!r} vs full "
            f"{full[: len(prompt)][-60:]!r}"
        )
    return prompt, full[len(prompt) :]


def _join(
    prompt_ids: list[int], answer_ids: list[int], eos_id: int | None, seq_len: int
) -> tuple[list, list]:
    if eos_id is not None and eos_id not in answer_ids:
        answer_ids = [*answer_ids, eos_id]
    input_ids = (prompt_ids + answer_ids)[:seq_len]
    labels = ([IGNORE_INDEX] * len(prompt_ids) + answer_ids)[:seq_len]
    return input_ids, labels


def tokenize_example(
    record: dict, tokenizer, seq_len: int, loss_on: str
) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of one ``{"prompt", "response"}`` or ``{"messages"}`` record, cut to
    ``seq_len``, the assistant turns ``loss_on`` names labelled (``all_assistant`` or
    ``last_assistant``, see the module docstring).

    The text is rendered by the tokenizer's chat template (a prompt/response record is one user turn
    and one assistant turn); for ``train_tokenizer``'s template that is bos, ``<|user|>``, the
    prompt, ``<|assistant|>`` (all labelled -100), then the response and eos (labelled with their
    ids). eos is appended when the template does not end the answer with it.

    Raises:
        ValueError: If the tokenizer has no chat template, or its rendering cannot be split into
            prompt and answers (one line saying which turn).
    """
    check_template(tokenizer)
    if loss_on == "all_assistant":
        input_ids, labels = all_assistant_labels(record, tokenizer)
        return input_ids[:seq_len], labels[:seq_len]
    prompt, answer = render(record, tokenizer)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    answer_ids = tokenizer.encode(answer, add_special_tokens=False)
    return _join(prompt_ids, answer_ids, tokenizer.eos_token_id, seq_len)


def all_assistant_labels(record: dict, tokenizer) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of the whole conversation with every assistant message's content and
    closing labelled (not cut to a length).

    Raises:
        ValueError: If a turn's rendering is not a prefix of the conversation's, or a content is
            not where its turn renders it, or a turn before the last closes with no special token.
    """
    messages = _messages(record)
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(encoded["input_ids"]), encoded["offset_mapping"]
    turns = [index for index, message in enumerate(messages) if message["role"] == "assistant"]
    starts = [_turn_start(messages[:index], tokenizer, full, ids, index) for index in turns]
    labels = [IGNORE_INDEX] * len(ids)
    closers = _special_ids(tokenizer)
    for number, (index, start, bound) in enumerate(
        zip(turns, starts, [*starts[1:], len(full)], strict=True), start=1
    ):
        begin, end = _content_span(messages[index]["content"], full, start, bound, index)
        close = _closing_end(ids, offsets, closers, end, bound)
        if close is None and number < len(turns):
            raise ValueError(
                f"the chat template closes assistant message {index + 1} with no special token, so "
                "its end cannot be told from the next turn's start: use data.loss_on=last_assistant"
            )
        for token, (first, last) in enumerate(offsets):
            if last > begin and first < (close if close is not None else bound):
                labels[token] = ids[token]
    eos = tokenizer.eos_token_id
    if close is None and eos is not None and ids[-1:] != [eos]:
        ids, labels = [*ids, eos], [*labels, eos]
    return ids, labels


def _turn_start(before: list[dict], tokenizer, full: str, ids: list[int], index: int) -> int:
    """Where assistant message ``index``'s turn starts in ``full``: the end of the rendering of the
    messages ``before`` it with the generation prompt, which must be a prefix of ``full`` in text
    and in tokens."""
    prompt = tokenizer.apply_chat_template(before, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    if not full.startswith(prompt) or ids[: len(prompt_ids)] != prompt_ids:
        raise ValueError(
            "the chat template cannot be split turn by turn: its rendering of the messages before "
            f"assistant message {index + 1} is not a prefix of the whole conversation's "
            f"({prompt[-40:]!r} vs {full[: len(prompt)][-40:]!r})"
        )
    return len(prompt)


def _content_span(content: str, full: str, start: int, bound: int, index: int) -> tuple[int, int]:
    """The characters of ``full`` between ``start`` and ``bound`` that are message ``index``'s
    content, as the template wrote it (verbatim, or trimmed as Llama 3's and Gemma's do)."""
    for text in (content, content.strip()):
        begin = full.find(text, start, bound)
        if text and begin >= 0:
            return begin, begin + len(text)
    if not content.strip():
        return start, start
    raise ValueError(
        f"the chat template does not write assistant message {index + 1}'s content in its turn, "
        "so its tokens cannot be labelled: use data.loss_on=last_assistant"
    )


def _special_ids(tokenizer) -> set[int]:
    """The ids of the tokenizer's special tokens (eos, ``<|im_end|>``, ``<|eot_id|>``, ...)."""
    added = getattr(tokenizer, "added_tokens_decoder", {})
    return set(tokenizer.all_special_ids) | {
        token_id for token_id, token in added.items() if token.special
    }


def _closing_end(
    ids: list[int], offsets: list, closers: set[int], end: int, bound: int
) -> int | None:
    """The end of the first special token the template writes after a content ending at ``end``
    and before ``bound`` (the turn's closing), or None when there is none."""
    for token_id, (first, last) in zip(ids, offsets, strict=True):
        if first >= bound:
            return None
        if first >= end and token_id in closers:
            return last
    return None


def labelled_tokens(labels: list[int]) -> int:
    """How many positions the loss counts: labels after the shift (``labels[1:]``) that are not
    -100."""
    return sum(label != IGNORE_INDEX for label in labels[1:])


def tokenize_batch(
    batch: dict[str, list], tokenizer, seq_len: int, loss_on: str
) -> dict[str, list]:
    """``tokenize_example`` over a column batch (``prompt``/``response`` or ``messages`` columns),
    for ``Dataset.map(batched=True)``: columns ``input_ids``, ``labels``, ``length`` (tokens) and
    ``labelled`` (labels the loss counts). A record that cannot be used gets empty ids and
    ``labelled`` = UNUSABLE.

    The first label of every example is -100: the loss never reads it unpacked (labels are shifted),
    and packed it keeps one example from being trained to predict the next one's first token.

    Raises:
        ValueError: If the tokenizer has no chat template.
    """
    check_template(tokenizer)
    size = len(next(iter(batch.values())))
    records = [{column: values[index] for column, values in batch.items()} for index in range(size)]
    if loss_on == "all_assistant":
        examples = [_usable_all_assistant(record, tokenizer, seq_len) for record in records]
    else:
        examples = _last_assistant_examples(records, tokenizer, seq_len)
    out: dict[str, list] = {"input_ids": [], "labels": [], "length": [], "labelled": []}
    for example in examples:
        input_ids, labels = example if example is not None else ([], [])
        labels[:1] = [IGNORE_INDEX] * len(labels[:1])
        out["input_ids"].append(input_ids)
        out["labels"].append(labels)
        out["length"].append(len(input_ids))
        out["labelled"].append(labelled_tokens(labels) if example is not None else UNUSABLE)
    return out


def _usable_all_assistant(record: dict, tokenizer, seq_len: int) -> tuple[list, list] | None:
    """The record's ``all_assistant`` (input_ids, labels), or None when it cannot be used."""
    try:
        if record_problem(record):
            return None
        return tokenize_example(record, tokenizer, seq_len, "all_assistant")
    except (
        Exception
    ):  # a template may raise anything (jinja's TemplateError); record_error says what
        return None


def _last_assistant_examples(
    records: list[dict], tokenizer, seq_len: int
) -> list[tuple[list, list] | None]:
    """The ``last_assistant`` (input_ids, labels) of each record (None: it cannot be used), the
    prompts and answers tokenized in one batch each."""
    prompts, answers, usable = [], [], []
    for record in records:
        try:
            if record_problem(record):
                raise ValueError(record_problem(record))
            prompt, answer = render(record, tokenizer)
        except Exception:  # a template may raise anything (jinja's TemplateError)
            prompt, answer = "", ""
            usable.append(False)
        else:
            usable.append(True)
        prompts.append(prompt)
        answers.append(answer)
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer(answers, add_special_tokens=False)["input_ids"]
    return [
        _join(prompt, answer, tokenizer.eos_token_id, seq_len) if ok else None
        for ok, prompt, answer in zip(usable, prompt_ids, answer_ids, strict=True)
    ]


def record_error(
    index: int, record: dict, tokenizer, seq_len: int, loss_on: str, group: int = 1
) -> DataError:
    """Why example ``index`` (0-based, marked by :func:`tokenize_batch`) cannot be trained on, as a
    one-line DataError naming its record 1-based (``record 1`` is the first, as JSONL errors say
    line 1); with ``group`` 2 (a preference record's chosen and rejected conversations) its
    answer too."""
    problem = record_problem(record)
    if problem is None:
        try:
            tokenize_example(record, tokenizer, seq_len, loss_on)
        except Exception as error:
            problem = str(error).splitlines()[0] if str(error) else type(error).__name__
        else:
            return DataError(
                f"{_name(index, group)} has no answer tokens within train.seq_len ({seq_len}): "
                "raise train.seq_len or shorten its prompt"
            )
    return DataError(f"{_name(index, group)}: {problem}")


def _name(index: int, group: int) -> str:
    if group == 1:
        return f"record {index + 1}"
    return f"record {index // group + 1} ({('chosen', 'rejected')[index % group]} answer)"
