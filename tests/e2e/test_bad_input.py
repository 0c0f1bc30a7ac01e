"""Bad input exits non-zero with one ``error:`` line on stderr, before any rank starts (how fast is
bench's job).

A module fixture runs the selected cases (see THROUGH_THE_COMMAND_LINE below) and each case then
gets its own assertion. Every case runs in ``make test`` (no ``sweep`` cases); one case selected
alone (``-k``) runs alone, where it once waited for all of them.
"""

import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import datasets
import pytest
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from components.data import DEFAULT_VOCAB_SIZE, train_tokenizer
from components.models import build_causal_lm
from components.runtime.output_dir import run_files
from recipes.tiny_models import tiny_config
from tests import cli
from tests.selection import is_selected, selected_params

# The module fixture runs every case (~40 processes of ~5 s of imports each, two at a time) inside
# the first test's set-up: give it room on a loaded machine.
pytestmark = pytest.mark.timeout(1200)

REPO = Path(__file__).resolve().parents[2]
COLUMNS = "data.columns={prompt: instruction, response: output}"

# name -> (overrides, text the error line must contain). {root} is a folder of prepared files (see
# inputs).
CASES: dict[str, tuple[list[str], str]] = {
    "unknown model": (
        ["model=gpt5"],
        "Could not find 'model/gpt5': model= takes one of llama, mixtral, pretrained, qwen3,",
    ),
    "misspelt key": (["train.max_stpes=5"], "Could not override 'train.max_stpes'"),
    "tp not dividing heads": (["tp=3", "nproc=3"], "tp (3) must divide num_attention_heads (8)"),
    "world size not factoring": (["tp=4", "nproc=6"], "world size 6 is not divisible by tp=4"),
    "dp times tp not the world size": (
        ["tp=2", "dp=3", "nproc=4"],
        "dp=3 × tp=2 = 6 does not match the world size 4",
    ),
    "missing pretrained_path": (
        ["model.pretrained_path=/nonexistent/model"],
        "model.pretrained_path='/nonexistent/model' is neither a local folder nor a Hugging Face "
        "Hub id",
    ),
    "ep not dividing the world": (
        ["model=qwen3_moe", "tp=2", "ep=4", "nproc=6"],
        "world size 6 is not divisible by ep=4",
    ),
    "ep not dividing the experts": (
        ["model=qwen3_moe", "ep=3", "nproc=3"],
        "ep (3) must divide the number of experts (8)",
    ),
    "a flash kernel under cp": (
        ["model.attn_implementation=flash_attention_3", "cp=2"],
        "model.attn_implementation=flash_attention_3 with cp=2 is not supported: context "
        "parallelism computes attention itself",
    ),
    "a LoRA key without peft=lora": (
        ["peft.rank=4"],
        "peft.rank=4 is read only with peft=lora or peft=qlora: add one or remove it",
    ),
    "LoRA on the experts of a dense model": (
        ["peft=lora", "peft.experts=true"],
        "peft.experts=true needs an MoE model: model=llama has no experts",
    ),
    "a LoRA target matching nothing among others": (
        ["peft=lora", "peft.target_modules=[*.q_proj,*.nothing]"],
        "peft.target_modules pattern '*.nothing' matches no module of LlamaForCausalLM: fix or "
        "remove it",
    ),
    "QLoRA tiles a split would cut": (
        ["peft=qlora", "tp=4", "peft.target_modules=[*.k_proj]"],
        "peft=qlora stores model.layers.0.self_attn.k_proj's weight in NF4 tiles of 16 × 16, and "
        "this rank's part of it is [8, 64]: use a tp that leaves multiples of 16",
    ),
    "QLoRA tiles FSDP would shard unevenly": (
        [
            "peft=qlora",
            "dp=3",
            "nproc=3",
            "train.global_batch_size=12",
            "peft.target_modules=[*.k_proj]",
        ],
        "peft=qlora shards each NF4 base over FSDP's 3 ranks (dp × cp) in whole tiles of 16 × 16, "
        "as many on each (torchao's NF4Tensor takes no uneven FSDP shards), and 3 does not divide "
        "the tiles of model.layers.0.self_attn.k_proj (8), model.layers.1.self_attn.k_proj (8)",
    ),
    "QLoRA with fp8": (
        ["peft=qlora", "train.precision=fp8"],
        "train.precision=fp8 with peft=lora or peft=qlora is not supported",
    ),
    "pp with cp": (["pp=2", "cp=2"], "pp=2 with cp=2 is not supported yet: use pp=1, or cp=1"),
    "ep on one process": (
        ["model=qwen3_moe", "ep=2"],
        "world size 1 is not divisible by ep=2; start 2 processes here with nproc=2, or use "
        "torchrun",
    ),
    "a folder given to data=jsonl": (
        ["data=jsonl", "data.path={root}"],
        "is a folder, and data=jsonl reads one JSONL file: give the file, or data=hf for a folder",
    ),
    "dense model with ep": (["ep=2", "tp=2"], "ep=2 needs an MoE model"),
    "moe option on a dense model": (
        ["moe.shard_experts=true"],
        "moe.shard_experts=true needs an MoE model: model=llama has no experts",
    ),
    "negative routing bias rate": (
        ["model=qwen3_moe", "moe.routing_bias_rate=-1"],
        "moe.routing_bias_rate=-1 is not valid: use 0 (off) or a positive number",
    ),
    "batch not dividing": (
        ["train.global_batch_size=10", "train.micro_batch_size=4"],
        "train.global_batch_size (10) must be divisible by train.micro_batch_size (4) × dp (1): "
        "use a multiple of 4",
    ),
    "tp not an integer": (["tp=two"], "tp='two' is not valid: use a positive integer, e.g. tp=2"),
    "seq_len not an integer": (
        ["train.seq_len=abc"],
        "train.seq_len='abc' is not valid: use an integer of at least 2",
    ),
    "seq_len too short for any answer": (
        ["train.seq_len=4"],
        "has no answer tokens within train.seq_len (4)",
    ),
    "negative lr": (["optim.lr=-1"], "optim.lr=-1 is not valid: use a positive number"),
    "unknown optimizer": (
        ["optim._target_=torch.optim.Adamm"],
        "optim._target_='torch.optim.Adamm' is not a class the optim group can build",
    ),
    "option the optimizer lacks": (
        ["+optim.momentum=0.9"],
        "optim.momentum is not an option of torch.optim.AdamW",
    ),
    "negative clip": (
        ["train.clip_grad_norm=-1"],
        "train.clip_grad_norm=-1 is not valid: use null (no clipping)",
    ),
    "negative val_every": (
        ["train.val_every=-1"],
        "train.val_every=-1 is not valid: use 0 (never)",
    ),
    "sp not a boolean": (["sp=maybe"], "sp='maybe' is not valid: use true or false"),
    "resume from nowhere": (
        ["checkpoint.resume=/nonexistent/ckpt"],
        "checkpoint.resume='/nonexistent/ckpt' does not",
    ),
    "resume from an unfinished save": (
        ["checkpoint.resume={root}/checkpoints/step_00000002.tmp"],
        "step_00000002.tmp' is an unfinished save",
    ),
    "resume from the checkpoints folder": (
        ["checkpoint.resume={root}/checkpoints"],
        "holds checkpoints but is not one: use checkpoint.resume={root}/checkpoints/step_00000004",
    ),
    "output_dir is a file": (
        ["output_dir={root}/a_file"],
        "output_dir='{root}/a_file' is a file, not a folder",
    ),
    "jsonl without a path": (["data=jsonl"], "data.path is not set: data=jsonl needs data.path="),
    "missing data file": (
        ["data=jsonl", "data.path={root}/nope.jsonl"],
        "nope.jsonl' does not exist",
    ),
    "empty data file": (
        ["data=jsonl", "data.path={root}/empty.jsonl"],
        "empty.jsonl has no records",
    ),
    "malformed data line": (
        ["data=jsonl", "data.path={root}/bad.jsonl"],
        "bad.jsonl line 2: not valid JSON",
    ),
    "val_fraction out of range": (
        ["data.val_fraction=1.5"],
        "data.val_fraction=1.5 is not valid: use a number in [0, 1)",
    ),
    "validation without records": (
        ["data.val_fraction=0"],
        "train.val_every=20 needs validation rows",
    ),
    "a negative weight in a mixture": (
        ["data=mix", "data.sources=[{name:a,weight:-1,kind:generated},{name:b,weight:1,kind:hf}]"],
        "data.sources[0].weight=-1: give a number >= 0 (a share of the rows); data.sources[1] (b): "
        "kind hf needs path",
    ),
    "a mixture of weights 0": (
        [
            "data=mix",
            "data.sources=[{name:a,weight:0,kind:generated},{name:b,weight:0,kind:generated}]",
        ],
        "data.sources: every weight is 0: give one a positive weight",
    ),
    "an unknown kind of source in a mixture": (
        ["data=mix", "data.sources=[{name:a,weight:1,kind:parquet}]"],
        "data.sources[0].kind='parquet': use one of generated, jsonl, hf",
    ),
    "a name given twice in a mixture": (
        [
            "data=mix",
            "data.sources=[{name:a,weight:1,kind:generated},{name:a,weight:1,kind:generated}]",
        ],
        "data.sources: 'a' names 2 sources: name each once",
    ),
    "a mixture without sources": (["data=mix"], "data.sources is not set (???): give it a value"),
    "a key nothing reads": (["+train.grad_accum=2"], "train.grad_accum is not a known key"),
    "a dtype key nothing reads": (["+model.dtype=bfloat16"], "model.dtype is not a known key"),
    "a model config key the family lacks": (
        ["+model.config.hiden_size=3"],
        "model.config.hiden_size is not a key of",
    ),
    "data.path without a data group that reads it": (
        ["+data.path=x.jsonl"],
        "data.path is not a key of GeneratedSource",
    ),
    "sp with seq_len tp does not divide": (
        ["tp=4", "sp=true", "train.seq_len=50"],
        "train.seq_len (50) must be divisible by tp (4) with sp=true",
    ),
    "seq_len beyond the model's positions": (
        ["train.seq_len=1000"],
        "exceeds the model's max_position_embeddings (model.config.max_position_embeddings=512): "
        "use train.seq_len=512 or less, or raise model.config.max_position_embeddings",
    ),
    # the tokenizer trained on this file has an odd size
    "sp with a trained vocabulary tp does not divide": (
        [
            "data=jsonl",
            "data.path={root}/arithmetic.jsonl",
            "data.val_fraction=0",
            "train.val_every=0",
            "tp=2",
            "sp=true",
        ],
        "sequence parallelism needs tp (2) to divide vocab_size",
    ),
    "a model folder without weights": (
        ["model=pretrained", "model.pretrained_path={root}/no_weights"],
        "has no weights",
    ),
    "a model folder with truncated weights": (
        ["model=pretrained", "model.pretrained_path={root}/truncated"],
        "model.safetensors cannot be read",
    ),
    "a model folder with weights of another shape": (
        ["model=pretrained", "model.pretrained_path={root}/wrong_shapes"],
        "holds tensors of another shape: model.layers.0.mlp.down_proj.weight [64, 96] (the model "
        "wants [64, 128])",
    ),
    "a safetensors index naming a file outside the folder": (
        ["model=pretrained", "model.pretrained_path={root}/index_outside"],
        "model.safetensors.index.json names '../outside.safetensors' (for lm_head.weight), "
        "outside the model folder",
    ),
    "an untied model folder without lm_head.weight": (
        ["model=pretrained", "model.pretrained_path={root}/no_head"],
        "lacks lm_head.weight (config.json has tie_word_embeddings=false",
    ),
    "a model folder without a tokenizer": (
        ["model=pretrained", "model.pretrained_path={root}/no_tokenizer"],
        "has no tokenizer that loads",
    ),
    "an X-MOD folder without a default language": (
        ["model=pretrained", "model.pretrained_path={root}/xmod_no_language"],
        "picks its language adapters by language ids, which the recipe does not pass (not "
        "supported), else by its config's default_language: {root}/xmod_no_language/config.json "
        "sets None, not one of its languages: set default_language to one of en_XX, de_DE",
    ),
    "an output_dir that cannot be created": (
        ["output_dir=/proc/shardtune"],
        "output_dir /proc/shardtune cannot be used",
    ),
    "a column mapping onto missing columns": (
        [
            "data=hf",
            "data.path={root}/chat.parquet",
            "data.columns={prompt: instr, response: output}",
        ],
        "data.columns prompt='instr': no such column",
    ),
    "a null cell the tokenizer trains on, named 1-based": (
        ["data=hf", "data.path={root}/nulls.parquet", COLUMNS],
        'data: record 2: needs "prompt" and "response" strings, or "messages"',
    ),
    "a split that does not exist": (
        ["data=hf", "data.path={root}/chat.parquet", "data.split=test"],
        "data.split='test'",
    ),
    "a Hub dataset offline": (
        ["data=hf", "data.path=someone/nothing"],
        "is not a local file or folder and the Hub",
    ),
    "seed out of range": (
        ["seed=99999999999999999999999"],
        "seed=99999999999999999999999 is not valid",
    ),
    "infinite lr": (["optim.lr=inf"], "optim.lr=inf is not valid"),
    "unresolvable interpolation": (
        ["train.seq_len=${oops}"],
        "train.seq_len='${oops}' cannot be resolved",
    ),
    "betas out of range": (
        ["optim.betas=[2.0,3.0]"],
        "Invalid beta parameter at index 0: 2.0; change",
    ),
    "negative weight decay": (["optim.weight_decay=-1"], "Invalid weight_decay value: -1; change"),
    "negative hidden size": (
        ["model.config.hidden_size=-64"],
        "model.config.hidden_size=-64 is not valid: use a positive integer",
    ),
    "heads not dividing the hidden size": (
        ["model.config.num_attention_heads=3"],
        "model.config: The hidden size (64) is not a multiple of the number of attention heads (3)",
    ),
    "a tensorboard log_dir that is a file": (
        ["logger=tensorboard", "logger.log_dir={root}/a_file"],
        "logger.log_dir='{root}/a_file' cannot be a folder: {root}/a_file is a file",
    ),
    "a wandb mode it does not take": (
        ["logger=wandb", "logger.mode=onlin"],
        "logger.mode='onlin' is not valid: use one of online, offline, disabled",
    ),
    # the checks run with no WANDB_API_KEY and a NETRC file that does not exist (case_env)
    "wandb online without a key": (
        ["logger=wandb", "logger.mode=online"],
        "logger.mode=online needs a W&B API key: set WANDB_API_KEY (or run `wandb login`), or use "
        "logger.mode=offline",
    ),
    "an MLflow server that does not answer": (
        ["logger=mlflow", "logger.tracking_uri=http://127.0.0.1:9"],
        "logger.tracking_uri='http://127.0.0.1:9' cannot be reached (127.0.0.1:9: ",
    ),
    "a cache that cannot be written": (
        ["cache_dir={root}/a_file"],
        "the cache folder {root}/a_file/data cannot be written (Not a directory): set "
        "SHARDTUNE_CACHE (or cache_dir=) to a writable folder",
    ),
    "more experts per token than the model has": (
        ["model=mixtral", "model.config.num_experts_per_tok=9"],
        "model.config.num_experts_per_tok=9 is more than the model's 8 experts "
        "(model.config.num_local_experts=8): each token is routed to that many different experts; "
        "use model.config.num_experts_per_tok=8 or less",
    ),
    "a character device as data": (
        ["data=jsonl", "data.path=/dev/zero"],
        "data.path='/dev/zero' is a character device, not a regular file: give a data file or "
        "folder",
    ),
    "a named pipe as data": (
        ["data=hf", "data.path={root}/fifo.jsonl"],
        "data.path='{root}/fifo.jsonl' is a named pipe (FIFO), not a regular file",
    ),
    "a replica drill without replicas": (
        ["debug.fault=perturb_replica@2", "dp=2", "nproc=2"],
        "debug.fault=perturb_replica@2 needs tp > 1: it acts on TP replicas, and at tp=1 there are "
        "none (the drill would change nothing); use e.g. tp=2",
    ),
    "fp8 with an MoE model": (
        ["model=qwen3_moe", "train.precision=fp8"],
        "train.precision=fp8 with an MoE model is not supported: torchao 0.18's float8 training "
        "converts nn.Linear layers, and the experts are grouped weights",
    ),
    "fp8 on a layer not a multiple of 16": (
        ["train.precision=fp8", "model.config.intermediate_size=72"],
        "train.precision=fp8 needs every matmul dimension a multiple of 16 (torch._scaled_mm), but "
        "model.layers.0.mlp.gate_proj has out_features=72, and 5 more layers",
    ),
    "fp8 with a rank's share of a layer below 16": (
        ["train.precision=fp8", "tp=4", "nproc=4"],
        "model.layers.0.self_attn.k_proj has out_features=32 (8 per rank at tp=4), and 3 more",
    ),
    "foreach asked over TP shards and plain replicas": (
        ["+optim.foreach=true", "tp=2"],
        "optim.foreach=true at tp=2 without data parallelism: the trainable parameters mix TP's "
        "DTensor shards with the plain replicas it leaves whole",
    ),
    "bf16 AdamW states on fp32 parameters": (
        ["optim=adamw_bf16"],
        "torchao.optim._AdamW keeps its state in the parameters' dtype, bf16 with "
        "train.precision=bf16 only (got train.precision=fp32)",
    ),
    "CPU offload with expert parallelism": (
        ["train.cpu_offload=true", "model=qwen3_moe", "tp=2", "ep=2"],
        "train.cpu_offload=true is not supported with ep=2: the experts split over ep are outside "
        "FSDP",
    ),
    "several problems at once": (
        ["tp=two", "optim.lr=0", "train.micro_batch_size=0"],
        "tp='two' is not valid: use a positive integer, e.g. tp=2; train.micro_batch_size=0 is "
        "not valid",
    ),
}


@dataclass
class Outcome:
    returncode: int
    stderr: str
    seconds: float
    root: Path


def model_folders(root: Path) -> None:
    """Tiny Llama folders, each broken one way."""
    tokenizer = train_tokenizer(
        ["hello world", "fine tuning"], DEFAULT_VOCAB_SIZE, root / "tokenizer"
    )
    config = tiny_config("llama", vocab_size=len(tokenizer))
    for name in ("no_weights", "truncated", "wrong_shapes", "no_tokenizer"):
        build = (
            tiny_config("llama", vocab_size=len(tokenizer), intermediate_size=96)
            if name == "wrong_shapes"
            else config
        )
        build_causal_lm(build, seed=0).save_pretrained(root / name)
        config.save_pretrained(
            root / name
        )  # the folder's config says 128: its weights were built with 96
        if name != "no_tokenizer":
            tokenizer.save_pretrained(root / name)
    (root / "no_weights" / "model.safetensors").unlink()
    untied_folders(root, tokenizer)
    sizes = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    languages = dict(languages=["en_XX", "de_DE"], default_language=None)  # none to default to
    xmod = AutoConfig.for_model("xmod", vocab_size=len(tokenizer), **sizes, **languages)
    AutoModelForCausalLM.from_config(xmod).save_pretrained(root / "xmod_no_language")
    tokenizer.save_pretrained(root / "xmod_no_language")
    weights = root / "truncated" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])


def untied_folders(root: Path, tokenizer) -> None:
    """Untied tiny Llamas: one without lm_head.weight, one whose index names a file beside it."""
    config = tiny_config("llama", vocab_size=len(tokenizer), tie_word_embeddings=False)
    for name in ("no_head", "index_outside"):
        build_causal_lm(config, seed=0).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    weights = root / "no_head" / "model.safetensors"
    tensors = load_file(weights)
    save_file({k: v for k, v in tensors.items() if k != "lm_head.weight"}, weights)
    folder = root / "index_outside"
    head = {"lm_head.weight": tensors.pop("lm_head.weight")}
    save_file(head, root / "outside.safetensors")
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    weight_map = {
        **dict.fromkeys(tensors, "model.safetensors"),
        **dict.fromkeys(head, "../outside.safetensors"),
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def inputs(root: Path) -> None:
    """The files the cases point at."""
    model_folders(root)
    records = [{"instruction": f"say {i}", "output": f"{i} {i}"} for i in range(20)]
    datasets.Dataset.from_list(records).to_parquet(root / "chat.parquet")
    nulls = [{"instruction": "say 1", "output": "1 1"}, {"instruction": "say 2", "output": None}]
    datasets.Dataset.from_list(nulls).to_parquet(root / "nulls.parquet")
    (root / "a_file").write_text("not a folder\n")
    os.mkfifo(root / "fifo.jsonl")  # a reader would wait on it forever
    (root / "empty.jsonl").write_text("\n")
    (root / "bad.jsonl").write_text(
        '{"prompt": "a", "response": "b"}\n{"prompt": "c", "response": "d"\n'
    )
    sums = [{"prompt": f"What is {i} plus {i}?", "response": f"It is {2 * i}."} for i in range(40)]
    (root / "arithmetic.jsonl").write_text("".join(json.dumps(record) + "\n" for record in sums))
    (root / "checkpoints" / "step_00000002.tmp").mkdir(parents=True)
    (root / "checkpoints" / "step_00000004").mkdir()
    (root / "checkpoints" / "step_00000004" / "COMPLETE").write_text("{}")


# These run as `python recipes/finetune.py ...`, each its own process, as a user runs them. The rest
# run the same two calls (compose, then the checks, printing through the same `fail`) one after
# another in a single process, a script started warm like the recipe (tests/cli.py), so the ~5 s
# start-up of torch and transformers is paid by no case.
THROUGH_THE_COMMAND_LINE = [
    "unknown model",
    "misspelt key",
    "tp not dividing heads",
    "several problems at once",
    "malformed data line",
    "a key nothing reads",
    "resume from an unfinished save",
    "a model folder without weights",
    "a Hub dataset offline",
    "output_dir is a file",
    "betas out of range",
]
FIFO = "a named pipe as data"  # the case whose refused folder the corrected rerun writes into
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
CHECKS_ONLY = """
import contextlib, io, json, sys
from components.runtime.problems import ConfigError, fail
from recipes.checks import check
from recipes.compose import compose
from recipes.prepare import prepare

results = {}
for name, overrides in json.loads(sys.argv[1]).items():
    stderr, code = io.StringIO(), 0
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        try:
            config = compose(overrides)
            try:
                prepare(check(config, str(config.hydra.run.dir)))
            except ConfigError as error:
                fail(str(error))
        except SystemExit as stop:
            code = stop.code
    results[name] = [code, stderr.getvalue()]
print(json.dumps(results))
"""


def case_env(root: Path) -> dict[str, str]:
    """The environment of every case: offline, and without a W&B key."""
    env = {**os.environ, **OFFLINE, "NETRC": str(root / "no_netrc")}
    env.pop("WANDB_API_KEY", None)
    return env


def overrides_of(name: str, root: Path) -> list[str]:
    overrides = [override.replace("{root}", str(root)) for override in CASES[name][0]]
    if not any(override.startswith("output_dir=") for override in overrides):
        overrides.append(f"output_dir={root / 'outputs' / str(list(CASES).index(name))}")
    return overrides


def run_case(name: str, root: Path) -> Outcome:
    started = time.monotonic()
    result = cli.run(
        [sys.executable, "recipes/finetune.py", *overrides_of(name, root)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=case_env(root),
    )
    return Outcome(result.returncode, result.stderr, time.monotonic() - started, root)


def run_checks_only(names: list[str], root: Path) -> dict[str, Outcome]:
    cases = json.dumps({name: overrides_of(name, root) for name in names})
    script = root / "checks_only.py"  # a script, not `python -c`: it starts warm
    script.write_text(CHECKS_ONLY)
    result = cli.run(
        [sys.executable, str(script), cases],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env=case_env(root),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return {
        name: Outcome(code, stderr, 0.0, root)
        for name, (code, stderr) in json.loads(result.stdout).items()
    }


@pytest.fixture(scope="module")
def outcomes(request, tmp_path_factory) -> dict[str, Outcome]:
    """The selected cases' outcomes, and the FIFO case's when the corrected rerun (into its
    refused folder) is selected."""
    root = tmp_path_factory.mktemp("bad_input")
    inputs(root)
    names = selected_params(request, "case")
    rerun = test_a_corrected_rerun_into_a_refused_folder_trains_and_says_what_it_does_not_read
    if is_selected(request, rerun) and FIFO not in names:
        names.append(FIFO)
    through = [name for name in THROUGH_THE_COMMAND_LINE if name in names]
    rest = [name for name in names if name not in THROUGH_THE_COMMAND_LINE]
    with ThreadPoolExecutor(2) as pool:
        checks_only = pool.submit(run_checks_only, rest, root)
        found = dict(
            zip(through, pool.map(lambda name: run_case(name, root), through), strict=True)
        )
        return {**found, **checks_only.result()}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_gives_one_error_line(case, outcomes):
    outcome = outcomes[case]
    expected = CASES[case][1].replace("{root}", str(outcome.root))
    assert outcome.returncode != 0
    lines = outcome.stderr.strip().splitlines()
    assert len(lines) == 1, outcome.stderr
    assert lines[0].startswith("error: ") and expected in lines[0], lines[0]
    # refused before anything was claimed: a corrected rerun into the same folder is not "another
    # run's files"
    folder = output_dir_of(case, outcome.root)
    assert not (folder.is_dir() and run_files(folder)), (
        f"the refused run left {run_files(folder)} in {folder}"
    )


def output_dir_of(case: str, root: Path) -> Path:
    given = next(o for o in overrides_of(case, root) if o.startswith("output_dir="))
    return Path(given.split("=", 1)[1])


def test_a_corrected_rerun_into_a_refused_folder_trains_and_says_what_it_does_not_read(outcomes):
    """One short run stands for every case above (none claimed its folder): the FIFO's, with a data
    file. At cp=2 (FSDP over the cp ranks) ``nan_grad`` strikes and the step is skipped, the keys
    this layout does not read (the pipeline's at pp=1 among them) are each noted once, and FSDP2
    warns of no view tensor."""
    root = outcomes[FIFO].root
    folder = output_dir_of(FIFO, root)
    data = ["data=jsonl", f"data.path={root / 'arithmetic.jsonl'}", "data.val_fraction=0"]
    small = ["train.max_steps=3", "train.val_every=0", "train.warmup_steps=1"]
    small += ["train.global_batch_size=4", "train.micro_batch_size=2", "checkpoint.export=false"]
    unread = ["sp=true", "device_memory_gib=80", "pp_schedule=interleaved_1f1b"]
    unread += ["pp_stages_per_rank=2"]
    fault = ["debug.fault=nan_grad@2", "train.on_nonfinite=skip"]
    result = cli.run(
        [sys.executable, "recipes/finetune.py", *data, *small, "cp=2", *unread, *fault,
         f"output_dir={folder}"],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=case_env(root),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    notes = [line for line in result.stdout.splitlines() if line.startswith("note: ")]
    sp = "note: sp=true changes nothing at tp=1: sequence parallelism splits the norms' sequence"
    memory = "note: device_memory_gib=80 is read by dry_run=true only (whether the planned layout"
    schedule = "note: pp_schedule=interleaved_1f1b is read with pp > 1 only: this run has pp=1"
    stages = "note: pp_stages_per_rank=2 is read with pp > 1 only: this run has pp=1"
    starts = (sp, memory, schedule, stages)
    assert [sum(note.startswith(start) for note in notes) for start in starts] == [1] * 4, notes
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [record.get("skipped", False) for record in records] == [False, True, False]
    assert "view tensor" not in result.stderr and "Warning" not in result.stderr, result.stderr


@pytest.mark.timeout(300)  # the schedule check once walked every step: hours for a billion
@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["schedule.min_lr_ratio=-0.5"], "gives a negative or non-finite learning rate"),
        # a sound schedule passes its check: the run is then refused by the data check after it
        (["data=jsonl", "data.path=/nonexistent/a.jsonl"], "data.path='/nonexistent/a.jsonl'"),
    ],
    ids=["bad schedule", "sound schedule"],
)
def test_a_billion_steps_are_checked_at_once(tmp_path, overrides, expected):
    result = cli.run(
        [
            sys.executable,
            "recipes/finetune.py",
            "train.max_steps=1000000000",
            *overrides,
            f"output_dir={tmp_path / 'out'}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, **OFFLINE},
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), result.stderr
    assert expected in lines[0], lines[0]
    assert (expected.startswith("gives")) == ("schedule" in lines[0]), lines[0]
