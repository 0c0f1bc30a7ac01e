"""Models whose forward lets a token see later ones, with no config flag that stops it, are refused:
next-token training through them would read the answer. CPM-Ant marks every token as context (the
coverage sweep: its tp=1 first loss 26.150 against its own forward's 26.469 on the same rows, the
two padded to different widths, which its left-padding mask reads differently)."""

import torch
from transformers import AutoModelForCausalLM, CpmAntConfig, LlamaConfig

from components.models.load import causal_problems

SIZES = dict(vocab_size=64, hidden_size=16, num_attention_heads=2, num_hidden_layers=1)


def _earlier_logits_move(config) -> float:
    """How far the logits of every position but the last move when the last token changes."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    tokens = torch.tensor([[5, 6, 7, 8, 9, 10]])
    changed = tokens.clone()
    changed[0, -1] = 11
    with torch.no_grad():
        before = model(input_ids=tokens, use_cache=False).logits[0, :-1]
        after = model(input_ids=changed, use_cache=False).logits[0, :-1]
    return (before - after).abs().max().item()


def test_cpmant_is_refused_in_one_line_saying_what_its_forward_does():
    assert causal_problems(CpmAntConfig()) == [
        "model type 'cpmant' is not a causal LM as transformers runs it: its forward marks every "
        "token as context (CpmAntModel.forward: context = 1), so each attends to the whole row, "
        "later tokens included, and it reads token id 0 as padding on the left of a row; "
        "next-token training through it would see the tokens it predicts: not supported"
    ]
    assert causal_problems(LlamaConfig()) == []


def test_the_refusal_is_true_cpmant_sees_later_tokens_and_llama_does_not():
    cpmant = CpmAntConfig(**SIZES, dim_head=8, dim_ff=32, prompt_length=4, prompt_types=3)
    llama = LlamaConfig(**SIZES, intermediate_size=32, num_key_value_heads=2)
    assert _earlier_logits_move(cpmant) > 1e-3
    assert _earlier_logits_move(llama) == 0.0
