"""Turn records into (input_ids, labels) with only the answer labelled.

Labels are aligned with ``input_ids`` (not shifted): ``cross_entropy_sum`` shifts them itself.
Everything the chat template writes before the final assistant message's content is the prompt and
gets ``-100``; the content and what the template closes it with (eos) are labelled, so the model
learns to answer and to stop. :func:`components.data.loader.collate_rows` lays them into batches,
padded on the right, which causal attention without a mask allows.

:func:`tokenize_batch` is the same per-record work in the shape
``datasets.Dataset.map(batched=True)`` wants; it never raises on a bad record (a worker process
would lose the message) but marks it, and :func:`record_error` says afterwards, for the first marked
record, what is wrong with it.
"""

from components.data.jsonl import DataError, record_problem

IGNORE_INDEX = -100
# ``labelled`` of a record that cannot be used at all (malformed, or the template cannot split it).
UNUSABLE = -1


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


def tokenize_example(record: dict, tokenizer, seq_len: int) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of one ``{"prompt", "response"}`` or ``{"messages"}`` record, cut to
    ``seq_len``.

    The text is rendered by the tokenizer's chat template (a prompt/response record is one user turn
    and one assistant turn); for ``train_tokenizer``'s template that is bos, ``<|user|>``, the
    prompt, ``<|assistant|>`` (all labelled -100), then the response and eos (labelled with their
    ids). eos is appended when the template does not end the answer with it.

    Raises:
        ValueError: If the tokenizer has no chat template, or its rendering of the conversation does
            not start with its rendering of the prompt (the answer cannot be told apart).
    """
    check_template(tokenizer)
    prompt, answer = render(record, tokenizer)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    answer_ids = tokenizer.encode(answer, add_special_tokens=False)
    return _join(prompt_ids, answer_ids, tokenizer.eos_token_id, seq_len)


def labelled_tokens(labels: list[int]) -> int:
    """How many positions the loss counts: labels after the shift (``labels[1:]``) that are not
    -100."""
    return sum(label != IGNORE_INDEX for label in labels[1:])


def tokenize_batch(batch: dict[str, list], tokenizer, seq_len: int) -> dict[str, list]:
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
    prompts, answers, usable = [], [], []
    for index in range(size):
        record = {column: values[index] for column, values in batch.items()}
        try:
            if record_problem(record):
                raise ValueError(record_problem(record))
            prompt, answer = render(record, tokenizer)
        except (
            Exception
        ):  # a template may raise anything (jinja's TemplateError); record_error says what
            prompt, answer = "", ""
            usable.append(False)
        else:
            usable.append(True)
        prompts.append(prompt)
        answers.append(answer)
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer(answers, add_special_tokens=False)["input_ids"]
    out: dict[str, list] = {"input_ids": [], "labels": [], "length": [], "labelled": []}
    for ok, prompt, answer in zip(usable, prompt_ids, answer_ids, strict=True):
        input_ids, labels = (
            _join(prompt, answer, tokenizer.eos_token_id, seq_len) if ok else ([], [])
        )
        labels[:1] = [IGNORE_INDEX] * len(labels[:1])
        out["input_ids"].append(input_ids)
        out["labels"].append(labels)
        out["length"].append(len(input_ids))
        out["labelled"].append(labelled_tokens(labels) if ok else UNUSABLE)
    return out


def record_error(index: int, record: dict, tokenizer, seq_len: int, group: int = 1) -> DataError:
    """Why example ``index`` (0-based, marked by :func:`tokenize_batch`) cannot be trained on, as a
    one-line DataError naming its record 1-based (``record 1`` is the first, as JSONL errors say
    line 1); with ``group`` 2 (a preference record's chosen and rejected conversations) its
    answer too."""
    problem = record_problem(record)
    if problem is None:
        try:
            tokenize_example(record, tokenizer, seq_len)
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
