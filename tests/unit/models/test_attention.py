"""model.attn_implementation: packed rows reach a packed-native kernel as sequence boundaries,
never as a dense sequence × sequence mask, and give sdpa's dense-mask logits; a kernel this run
cannot use is one problem before any rank starts.

Two packed rows of a tiny Llama (examples of 5, 12 and 9 tokens, then padding; 7 and 25 tokens).
flash-attn is not installed here: a kernel standing in for flash_attention_2 is registered with
transformers' AttentionInterface. It computes causal attention within each sequence of the
cumulative lengths it is given, and with none over the whole row, as flash's non-varlen path does.
"""

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask
from transformers import AttentionInterface, GPTJConfig

from components.data.loader import collate_rows
from components.models import build_causal_lm
from components.models.attention import attention_choice_problems, pass_sequence_boundaries
from components.training.step import model_inputs
from recipes.checks import model_problems
from recipes.compose import compose
from recipes.tiny_models import tiny_config
from recipes.validate import validate

SEQ = 32
EXAMPLES = [[5, 12, 9], [7, 25]]  # tokens of each row's examples; row 0 ends in 6 of padding
BOUNDARIES = [0, 5, 17, 32, 39, 64]  # where sequences start over the flattened rows, and the end
TOLERANCE = dict(rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def packed():
    """The model's inputs for the two packed rows, as the training step makes them."""
    generator = torch.Generator().manual_seed(0)
    rows = [
        [(ids := torch.randint(3, 256, (n,), generator=generator).tolist(), ids) for n in row]
        for row in EXAMPLES
    ]
    batch = collate_rows(rows, SEQ, pad_id=0)
    inputs, _, _ = model_inputs(batch.input_ids, batch.labels, batch.position_ids, None)
    return inputs


@pytest.fixture(scope="module")
def dense_logits(packed):
    """sdpa's logits: transformers' dense block-diagonal mask from the restarting positions."""
    model = build_causal_lm(tiny_config("llama"), seed=0)
    with torch.no_grad():
        return model(**packed, use_cache=False).logits


def varlen_causal(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """flash_attention_2's stand-in: query [batch, heads, seq, dim] in, [batch, seq, heads, dim]
    out. Causal within each sequence of ``cu_seq_lens_q`` over the flattened rows; without them,
    causal over each whole row."""
    batch, heads, seq, dim = query.shape
    flat = [t.transpose(1, 2).reshape(batch * seq, t.shape[1], dim) for t in (query, key, value)]
    bounds = kwargs.get("cu_seq_lens_q")
    bounds = bounds.tolist() if bounds is not None else list(range(0, batch * seq + 1, seq))
    pieces = [
        F.scaled_dot_product_attention(
            *(t[start:end].transpose(0, 1) for t in flat),
            is_causal=True,
            scale=scaling,
            enable_gqa=True,
        ).transpose(0, 1)
        for start, end in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    return torch.cat(pieces).reshape(batch, seq, heads, dim), None


@pytest.fixture
def fake_flash(monkeypatch):
    """Every call of the stand-in kernel: its positional arguments and keyword arguments."""
    calls = []

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return varlen_causal(*args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, "flash_attention_2", spy)
    return calls


def flash_model():
    """The tiny Llama with flash_attention_2 set as a run with it sets it (the config, before the
    build, which would check flash-attn is installed: set on the built model here)."""
    model = build_causal_lm(tiny_config("llama"), seed=0)
    model.config._attn_implementation = "flash_attention_2"
    return model


def test_flash_gets_sequence_boundaries_and_no_dense_mask(packed, dense_logits, fake_flash):
    model = flash_model()
    pass_sequence_boundaries(model)
    with torch.no_grad():
        logits = model(**packed, use_cache=False).logits
    assert len(fake_flash) == model.config.num_hidden_layers
    for args, kwargs in fake_flash:
        assert args[4] is None  # the attention mask
        assert kwargs["cu_seq_lens_q"].tolist() == BOUNDARIES
        assert kwargs["cu_seq_lens_k"].tolist() == BOUNDARIES
        assert kwargs["max_length_q"] == kwargs["max_length_k"] == SEQ
        tensors = [t for t in (*args[1:], *kwargs.values()) if isinstance(t, torch.Tensor)]
        assert not [t.shape for t in tensors if t.dim() >= 2 and t.shape[-2:] == (SEQ, SEQ)]
    torch.testing.assert_close(logits, dense_logits, **TOLERANCE)


def test_without_the_boundaries_flash_lets_packed_examples_attend_to_each_other(
    packed, dense_logits, fake_flash
):
    with torch.no_grad():
        logits = flash_model()(**packed, use_cache=False).logits
    assert "cu_seq_lens_q" not in fake_flash[0][1]
    first = slice(0, EXAMPLES[0][0])  # the first example of a row sees nothing before it
    torch.testing.assert_close(logits[:, first], dense_logits[:, first], **TOLERANCE)
    assert (logits - dense_logits).abs().max() > 1e-2


def test_compiled_flex_attention_forward_equals_sdpa_with_its_dense_mask(
    packed, dense_logits, monkeypatch
):
    masks, flex = [], AttentionInterface._global_mapping["flex_attention"]

    def spy(module, query, key, value, attention_mask, **kwargs):
        masks.append(attention_mask)
        return flex(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, "flex_attention", spy)
    model = build_causal_lm(tiny_config("llama"), seed=0)
    model.set_attn_implementation("flex_attention")
    with torch.no_grad():  # no flex_attention backward on the CPU
        logits = model(**packed, use_cache=False).logits
    assert len(masks) == model.config.num_hidden_layers
    assert all(isinstance(mask, BlockMask) for mask in masks)
    torch.testing.assert_close(logits, dense_logits, **TOLERANCE)


def checked_model(overrides: list[str]):
    """The model checks of a run composed from ``overrides`` on this CPU."""
    return model_problems(validate(compose(overrides)), None, "cpu")


def run_problems(overrides: list[str]) -> list[str]:
    found = checked_model(overrides).problems
    return [f"{problem.key}: {problem.message}" for problem in found]


FLASH_MISSING = importlib.util.find_spec("flash_attn") is None


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["model.attn_implementation=flash_attention_2", "train.precision=bf16-mixed"],
            "model.attn_implementation: model.attn_implementation=flash_attention_2 "
            + (
                "needs the flash-attn package, which is not installed"
                if FLASH_MISSING
                else "runs on CUDA only, not cpu"
            ),
        ),
        (
            ["model.attn_implementation=flex_attention"],
            "model.attn_implementation: model.attn_implementation=flex_attention cannot train on "
            "the CPU: PyTorch's "
            "flex_attention has no backward there",
        ),
        (
            ["+model.config.attn_implementation=eager"],
            "model.config.attn_implementation: model.config.attn_implementation=eager is refused: "
            "the attention kernel is set once, by model.attn_implementation; use "
            "model.attn_implementation=eager",
        ),
    ],
)
def test_a_kernel_this_run_cannot_use_is_one_problem(overrides, expected):
    found = run_problems(overrides)
    assert len(found) == 1 and found[0].startswith(expected), found


def test_the_kernel_chosen_is_the_one_the_built_model_runs():
    checked = checked_model(["model.attn_implementation=eager"])
    assert checked.problems == []
    assert build_causal_lm(checked.config, seed=0).config._attn_implementation == "eager"
    default = checked_model(["model.attn_implementation=null"])
    assert default.problems == [] and default.config._attn_implementation is None
    assert build_causal_lm(default.config, seed=0).config._attn_implementation == "sdpa"


def test_what_a_kernel_cannot_run_is_said_whatever_the_machine():
    llama = tiny_config("llama")
    (cp,) = attention_choice_problems("eager", llama, "cuda", "bf16", 2)
    assert "with cp=2 is not supported: context parallelism computes attention itself" in cp
    fp32 = attention_choice_problems("flash_attention_3", llama, "cuda", "fp32", 1)
    assert (
        "with train.precision=fp32 is not supported: flash attention computes in bf16" in (fp32[-1])
    )
    (gptj,) = attention_choice_problems("sdpa", GPTJConfig(), "cpu", "fp32", 1)
    assert gptj.startswith(
        "model.attn_implementation=sdpa is not supported by model type 'gptj': transformers' "
        "GPTJForCausalLM has no sdpa path"
    )
    assert attention_choice_problems(None, GPTJConfig(), "cpu", "fp32", 2) == []
