"""Hugging Face configs of models built from a config (no checkpoint): a family's class plus
explicit sizes.

The sizes are data, not code: the recipe takes them from ``model.config``
(``conf/model/<family>.yaml``, overridable on the command line; ``recipes/tiny_models.py`` reads the
same files for tests and benchmarks).
"""

import functools
import inspect
import re
from typing import Any

from huggingface_hub.errors import StrictDataclassError
from transformers import PretrainedConfig

from components.models.families import FAMILIES

# Read by every family's attention (``getattr(config, "head_dim", ...)``) though not every config
# declares it.
READ_BY_MODELS = frozenset({"head_dim"})
# Sizes and counts (hidden_size, head_dim, num_attention_heads, ...): each at least 1.
SIZE_KEY = re.compile(r"^(num_\w+|\w+_size|head_dim|max_position_embeddings)$")


@functools.cache
def known_keys(family: str) -> frozenset[str]:
    """Every key a ``family`` config accepts: its attributes, its constructor's parameters and
    settable properties (``attn_implementation``)."""
    config_class = FAMILIES[family].config_class()
    members = inspect.getmembers(config_class)
    settable = {
        name.lstrip("_") for name, value in members if isinstance(value, property) and value.fset
    }
    parameters = set(inspect.signature(config_class.__init__).parameters) - {"self"}
    return frozenset(config_class().to_dict()) | parameters | settable | READ_BY_MODELS


def config_errors(family: str | None, sizes: dict[str, Any]) -> list[str]:
    """Why ``family`` with ``sizes`` cannot be built (an unknown family, keys the config does not
    have, a size or count below 1)."""
    if family not in FAMILIES:
        return [
            f"model.family={family!r} is not a known family: use one of "
            f"{', '.join(sorted(FAMILIES))}"
        ]
    unknown = sorted(set(sizes) - known_keys(family))
    config_name = FAMILIES[family].config_name
    errors = [f"model.config.{name} is not a key of {config_name}: remove it" for name in unknown]
    small = sorted(key for key, value in sizes.items() if SIZE_KEY.match(key) and _below_one(value))
    errors += [f"model.config.{k}={sizes[k]} is not valid: use a positive integer" for k in small]
    return errors


def _below_one(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value < 1


def build_config(family: str, sizes: dict[str, Any]) -> PretrainedConfig:
    """The ``family`` config with exactly ``sizes`` set (the rest, and a null size, are the class
    defaults).

    Raises:
        ValueError: If the family is unknown or a key is not one of its config's (see
            :func:`config_errors`), or the config's own validation refuses the sizes (heads that do
            not divide hidden_size).
    """
    errors = config_errors(family, sizes)
    if errors:
        raise ValueError("; ".join(errors))
    given = {key: value for key, value in sizes.items() if value is not None}  # null: the default
    try:
        return FAMILIES[family].config_class()(**given)
    except StrictDataclassError as error:  # transformers' validators: the cause reads best
        raise ValueError(f"model.config: {error.__cause__ or error}") from None


def vocab_size_errors(sizes: dict[str, Any]) -> list[str]:
    """A ``model.config.vocab_size`` that no tokenizer trained on the data fits (each holds every
    byte and the special tokens), refused before the config is built."""
    from components.data.tokenizer import MIN_VOCAB_SIZE  # the tokenizers package: when asked

    given = sizes["vocab_size"] if "vocab_size" in sizes else None
    if not isinstance(given, int) or given >= MIN_VOCAB_SIZE:
        return []
    return [
        f"model.config.vocab_size={given} cannot hold the tokenizer trained on the data (at least "
        f"{MIN_VOCAB_SIZE} tokens: every byte and the special tokens): use a larger size, or null "
        "for the tokenizer's"
    ]


def vocab_size_for(given: int | None, tokenizer_size: int) -> int:
    """The vocabulary of a model built from a config: ``model.config.vocab_size`` as given (rows
    past the tokenizer stay unused), or, when null, the tokenizer's size.

    Raises:
        ValueError: If a given size cannot hold every token id of the tokenizer.
    """
    if given is None:
        return tokenizer_size
    if given < tokenizer_size:
        raise ValueError(
            f"model.config.vocab_size={given} is smaller than the tokenizer's {tokenizer_size} "
            f"tokens: use model.config.vocab_size={tokenizer_size} or more, or null for the "
            "tokenizer's size"
        )
    return given


# Where a family's config keeps its routed-expert count (Qwen-MoE, Mixtral and GPT-OSS, DeepSeek).
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def routing_errors(config: PretrainedConfig, prefix: str = "model.config.") -> list[str]:
    """An MoE config that routes each token to more experts than a layer has
    (``num_experts_per_tok`` above the expert count): ``torch.topk`` would fail in the first
    forward, on every rank. ``prefix`` names the keys (``model.config.``, or a folder's
    ``config.json``)."""
    key = next((name for name in EXPERT_COUNT_KEYS if getattr(config, name, None)), None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if key is None or not isinstance(top_k, int) or top_k <= getattr(config, key):
        return []
    experts, key = getattr(config, key), config.attribute_map.get(key, key)  # Mixtral's real name
    return [
        f"{prefix}num_experts_per_tok={top_k} is more than the model's {experts} experts "
        f"({prefix}{key}={experts}): each token is routed to that many different experts; use "
        f"{prefix}num_experts_per_tok={experts} or less"
    ]
