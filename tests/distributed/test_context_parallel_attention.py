"""Context parallelism runs each layer's attention as the model's config asks: real tiny Gemma 3
(layers alternating sliding window 8 and full), Gemma 2 (alternating, attention logit softcapping
1.0, eager), GPT-OSS (alternating, attention sinks, eager) and Nemotron (whose decoder layers drop
the keyword arguments the model's forward is given) train 3 steps at cp=2 on two gloo
ranks exactly as in one process (loss and grad norm within 1e-5 relative, SGD and AdamW, fp32),
on packed rows (seq 64) whose documents cross the cp chunks. GPT-OSS on unpacked rows: its forward
builds its masks without the position ids, so in one process its packed documents attend to each
other (context parallelism keeps them apart, as for every model). Each rank's mask matches the one
transformers builds for the whole sequence, sliced to its queries and the gathered keys.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GptOssConfig,
    NemotronConfig,
)
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from components.distributed.context_parallel import (
    ContextParallel,
    CpLayout,
    enable_context_parallel,
    zigzag_indices,
)
from components.distributed.grads import grad_norm
from components.training.step import forward_backward
from tests.harness import mesh

BATCH, SEQ, STEPS, VOCAB = 2, 64, 3, 128
SIZES = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "head_dim": 8}
SIZES |= {"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB}
DENSE = dict(SIZES)  # every layer full attention
SIZES |= {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}
CONFIGS = {
    "gemma3": lambda: Gemma3TextConfig(**SIZES, attn_implementation="sdpa"),
    "gemma2": lambda: Gemma2Config(**SIZES, attn_logit_softcapping=1.0),
    "gpt_oss": lambda: GptOssConfig(**SIZES, num_local_experts=2, num_experts_per_tok=1),
    "nemotron": lambda: NemotronConfig(**DENSE, attn_implementation="sdpa"),
}
OPTIMIZERS = {"sgd": (torch.optim.SGD, {"lr": 0.5}), "adamw": (torch.optim.AdamW, {"lr": 3e-3})}


def packed_batch(step: int, packed: bool = True):
    """(input_ids, labels, position_ids, labelled tokens): documents of 7..20 tokens, positions
    restarting at each (one document a row when not ``packed``)."""
    generator = torch.Generator().manual_seed(200 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels, positions = tokens.clone(), torch.arange(SEQ).repeat(BATCH, 1)
    for row in range(BATCH):
        start = 0 if packed else SEQ
        while start < SEQ:
            positions[row, start:] = torch.arange(SEQ - start)
            labels[row, start] = -100
            start += int(torch.randint(7, 21, (1,), generator=generator))
    return tokens, labels, positions, int((labels[:, 1:] != -100).sum())


def curve(model, optimizer: str, cp: ContextParallel | None, packed: bool) -> list:
    """(mean loss, grad norm) per step; under ``cp`` the losses and gradients summed over it."""
    make, options = OPTIMIZERS[optimizer]
    optim, points = make(model.parameters(), **options), []
    for step in range(STEPS):
        ids, labels, positions, labelled = packed_batch(step, packed)
        optim.zero_grad()
        loss = torch.tensor(forward_backward(model, ids, labels, labelled, positions, cp=cp))
        if cp is not None:
            dist.all_reduce(loss, group=cp.group)
            for parameter in model.parameters():
                dist.all_reduce(parameter.grad, group=cp.group)
        points.append((loss.item() / labelled, grad_norm([model]).item()))
        optim.step()
    return points


def check_parity(rank, world_size, name: str, optimizer: str):
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(CONFIGS[name](), dtype=torch.float32)
    parallel = copy.deepcopy(reference)
    enable_context_parallel(parallel)
    cp = ContextParallel.of(mesh((world_size,), ("cp",)))
    packed = name != "gpt_oss"
    return curve(parallel, optimizer, cp, packed), curve(reference, optimizer, None, packed)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_cp2_trains_what_one_process_trains(ranks2, name, optimizer):
    gaps = [
        abs(got - want) / abs(want)
        for ours, reference in ranks2.run(check_parity, name, optimizer)
        for point, expected in zip(ours, reference, strict=True)
        for got, want in zip(point, expected, strict=True)
    ]
    print(f"{name} {optimizer}: worst gap {max(gaps):.1e}")
    assert max(gaps) <= 1e-5


def test_each_layer_mask_is_transformers_own_sliced():
    config = CONFIGS["gemma3"]()
    _, _, positions, _ = packed_batch(0)
    embeds = torch.zeros(BATCH, SEQ, 1)
    whole = {
        "full_attention": create_causal_mask(
            config, embeds, None, None, positions, allow_is_causal_skip=False
        ),
        "sliding_attention": create_sliding_window_causal_mask(
            config, embeds, None, None, positions, allow_is_causal_skip=False
        ),
    }
    assert not torch.equal(*whole.values())
    keys = torch.cat([zigzag_indices(SEQ, rank, 2) for rank in range(2)])
    for rank in range(2):
        queries = zigzag_indices(SEQ, rank, 2)
        layout = CpLayout(queries=queries, keys=keys, position_ids=positions)
        for layer, kind in enumerate(config.layer_types):
            expected = whole[kind][:, :, queries][:, :, :, keys]
            assert torch.equal(layout.mask(config, layer), expected), (rank, kind)
