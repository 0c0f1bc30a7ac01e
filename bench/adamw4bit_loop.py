"""torchao's ``AdamW4bit`` against torch's ``AdamW`` in a bare loop on one process (issue 47): is
``optim=adamw4bit``'s loss gap the 4-bit method's, or shardtune's use of it?

    .venv/bin/python bench/adamw4bit_loop.py [--steps 30] [--lr 3e-4] [--shape 256|512]

The recipe's own batches (its compose, checks and preparation of the embedded data, tp=1) and
seeded weights of a Llama 256 wide (2 layers, MLP 512, head_dim 32: the acceptance's shape) or 512
wide (4 layers, MLP 1024, head_dim 64), trained by bench/recipe_overhead.py's bare ``loop``
(forward, summed cross entropy / labelled tokens, backward, clip, step, the plan's schedule) with
each optimizer in turn; nothing of the recipe's step, DTensor or FSDP. Variants of the 4-bit
state, made by giving torchao's step state tensors created here: ``m1``/``m2`` only the first /
second moment in 4 bits (the other fp32), ``head32`` the output head's moments fp32, ``b32`` blocks
of 32 values. Printed per optimizer: the final loss and the worst per-step relative gap to AdamW.
"""

import argparse
import tempfile
from pathlib import Path

import torch
from recipe_overhead import Workload, loop  # bench/, beside this file
from torchao.optim import AdamW4bit, AdamW8bit
from torchao.optim.subclass_4bit import OptimState4bit

from components.data.streaming import open_loaders
from components.models import build_causal_lm
from components.training.schedule import build_schedule
from recipes.checks import check
from recipes.compose import compose
from recipes.prepare import prepare

SHAPES = {
    "256": dict(hidden_size=256, intermediate_size=512, head_dim=32),
    "512": dict(hidden_size=512, intermediate_size=1024, head_dim=64, num_hidden_layers=4),
}
VARIANTS = ("adamw", "adamw8bit", "adamw4bit", "m1", "m2", "b32", "head32", "head32_b32")


def recipe_workload(shape: str, steps: int, lr: float, folder: Path, variant: str) -> Workload:
    """The recipe's batches of ``steps`` steps; a fresh model, ``variant``'s optimizer and the
    plan's schedule at each setup."""
    overrides = [f"model.config.{key}={value}" for key, value in SHAPES[shape].items()]
    overrides += [f"train.max_steps={steps}", f"optim.lr={lr}", "train.val_every=0"]
    plan, lock = prepare(check(compose([*overrides, f"output_dir={folder}"])))
    if lock is not None:
        lock.release()
    train = plan.train
    splits = (plan.data.train, None, {}, train.global_batch_size, train.micro_batch_size)
    where = dict(dp_size=1, dp_rank=0, seed=plan.seed, group=None, pad_multiple=plan.pad_multiple)
    data = open_loaders(*splits, **where)[0]
    batches = [data.batches_for_step(step) for step in range(steps)]

    def setup():
        model = build_causal_lm(plan.model.config, seed=plan.model.seed).train()
        optimizer = build(variant, model, lr)
        sizes = (train.warmup_steps, train.max_steps, plan.schedule.options())
        return model, optimizer, build_schedule(optimizer, plan.schedule.name, *sizes)

    return Workload(
        setup=setup,
        steps=[[(batch.input_ids, batch.labels) for batch in step] for step in batches],
        tokens=[data.tokens_in_step(step) for step in range(steps)],
        clip=train.clip_grad_norm,
    )


def build(variant: str, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """``variant``'s optimizer with conf/optim's betas and weight decay."""
    options = dict(lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    params = list(model.parameters())
    if variant == "adamw":
        return torch.optim.AdamW(params, **options)
    if variant == "adamw8bit":
        return AdamW8bit(params, **options, block_size=256)
    block = 32 if variant.endswith("b32") else 128
    optimizer = AdamW4bit(params, **options, block_size=block)
    if variant in ("m1", "m2", "head32", "head32_b32"):
        fp32 = {id(model.lm_head.weight)} if variant.startswith("head32") else set()
        moments = {"m1": (True, False), "m2": (False, True)}.get(variant, (True, True))
        for param in params:
            four = param.numel() >= 4096 and param.numel() % block == 0 and id(param) not in fp32
            optimizer.state[param] = {
                "step": torch.tensor(0.0),
                "exp_avg": _moment(param, four and moments[0], True, block),
                "exp_avg_sq": _moment(param, four and moments[1], False, block),
            }
    return optimizer


def _moment(param: torch.Tensor, four: bool, signed: bool, block: int) -> torch.Tensor:
    """A zero moment as torchao's step creates it: 4-bit codes, or fp32."""
    if four:
        return OptimState4bit.zeros(param.shape, signed, block, param.device, dtype=param.dtype)
    return torch.zeros_like(param)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="256")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    args = parser.parse_args()
    curves: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="adamw4bit_loop_") as folder:
        for variant in ["adamw", *[name for name in args.variants if name != "adamw"]]:
            work = recipe_workload(args.shape, args.steps, args.lr, Path(folder) / variant, variant)
            loop(work, curves.setdefault(variant, []))
    print("| optimizer | final loss | worst gap to adamw (step) |")
    print("|---|---|---|")
    for variant, losses in curves.items():
        gaps = [abs(loss - base) / base for loss, base in zip(losses, curves["adamw"], strict=True)]
        worst = max(range(len(gaps)), key=gaps.__getitem__)
        print(f"| {variant} | {losses[-1]:.4f} | {gaps[worst]:.2e} ({worst + 1}) |")


if __name__ == "__main__":
    main()
