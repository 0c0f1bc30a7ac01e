"""A small byte-level BPE tokenizer trained on the run's own text, with a chat template for its
special tokens.

The tiny demo model needs a vocabulary sized to it (a few hundred tokens, divisible by the
tensor-parallel degree so the embedding and ``lm_head`` can be vocab-sharded), not a pretrained
32k-150k one. Byte-level means any text encodes, including characters the training text never had.

BPE training costs grow faster than linearly in the length of a text (a 10 MB line takes
minutes), and a few hundred merges need little text: the trainer sees at most
:data:`MAX_TRAINING_CHARS` characters in all, each text cut to :data:`MAX_CHARS_PER_TEXT`, so
training time is bounded whatever the data.
"""

from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

# Divisible by 4, so a model whose vocab_size equals it shards its vocabulary evenly at tp = 1, 2 or
# 4.
DEFAULT_VOCAB_SIZE = 384

PAD, BOS, EOS, USER, ASSISTANT = "<|pad|>", "<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, USER, ASSISTANT]  # ids 0..4, in this order

# bos, then each turn after its role marker; an assistant turn ends with eos. A system message has
# no marker
# of its own: its text comes first, on its own line. add_generation_prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n"
    "{% elif message['role'] == 'user' %}<|user|>{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}<|assistant|>{{ message['content'] }}{{ eos_token }}"
    "{% else %}{{ raise_exception('unknown chat role ' ~ message['role'] ~ '; use system, user or "
    "assistant') }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)  # every byte, plus the special tokens

# A few hundred merges are learnt from far less; the default 4000-record set has about 100k
# characters.
MAX_TRAINING_CHARS = 2_000_000
MAX_CHARS_PER_TEXT = 4_000


def training_texts(records: Iterable[dict]) -> list[str]:
    """The strings of ``{"prompt", "response"}`` or ``{"messages"}`` records, to train a tokenizer
    on."""
    texts = []
    for record in records:
        if record.get("messages") is not None:
            texts += [message["content"] for message in record["messages"]]
        else:
            texts += [record["prompt"], record["response"]]
    return texts


def capped_texts(
    texts: Iterable[str], max_chars: int = MAX_TRAINING_CHARS, per_text: int = MAX_CHARS_PER_TEXT
) -> Iterator[str]:
    """The first texts of ``texts``, each cut to ``per_text`` characters, until ``max_chars`` are
    handed out.

    Lazy: a generator over a large dataset is read only as far as the cap. A text that is not a
    string (a null cell) is passed over: tokenizing then names its record.
    """
    left = max_chars
    for text in texts:
        if not isinstance(text, str):
            continue
        piece = text[: min(per_text, left)]
        left -= len(piece)
        yield piece
        if left <= 0:
            return


def train_tokenizer(
    texts: Iterable[str], vocab_size: int, out_dir: str | Path
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``texts`` (capped by :func:`capped_texts`), save it to ``out_dir``
    and return it loaded back from there.

    Same texts and ``vocab_size`` give the same vocabulary. The tokenizer's length (special tokens
    included) is at most ``vocab_size``, so a model can use exactly ``vocab_size``; it is less when
    the texts run out of pairs worth merging. Nothing is added to encoded text automatically: the
    chat template writes bos, role markers and eos.

    Raises:
        ValueError: If ``vocab_size`` cannot hold every byte plus the special tokens.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"tokenizer vocab_size ({vocab_size}) must be at least {MIN_VOCAB_SIZE}: 256 bytes "
            "plus "
            f"{len(SPECIAL_TOKENS)} special tokens; use e.g. {DEFAULT_VOCAB_SIZE}"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(capped_texts(texts)), trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        extra_special_tokens=[USER, ASSISTANT],
        chat_template=CHAT_TEMPLATE,
    )
    wrapped.save_pretrained(str(out_dir))
    loaded = AutoTokenizer.from_pretrained(str(out_dir), trust_remote_code=False)
    if (
        len(loaded) > vocab_size
    ):  # BPE training never exceeds it; this guards the model-size contract
        raise ValueError(
            f"trained tokenizer has {len(loaded)} tokens, more than vocab_size ({vocab_size})"
        )
    return loaded
