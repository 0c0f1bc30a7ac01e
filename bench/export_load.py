"""Peak RSS per rank of the Hugging Face export (gathered to rank 0 against every rank writing its
part) and of the sharded load (``materialize_pretrained``), against the rank's shard.

Why: issue 24 asks that no rank hold more than its shard plus one tensor while exporting, and that
a load reads only the rank's slices (goal: peak <= 1.3x the shard, plus the process's baseline).

Each measurement runs on fresh gloo ranks (``launch_local``) holding a Llama of ``--hidden`` x
``--layers`` (MLP 4 x hidden, vocab 32000, fp32; 66M parameters, 253 MiB at the defaults) at each
``--tp``:

- ``load``: the model built on the meta device, TP-sharded, then ``materialize_pretrained`` from a
  ``save_pretrained`` folder (one ``model.safetensors``);
- ``export parallel``: that model exported by ``export_hf`` (every rank writes its part);
- ``export gathered``: the export as it was before: the full state dict gathered to rank 0 on the
  CPU (``full_state_dict`` + ``cpu_offload``), which writes it with ``save_file``.

A figure is the peak RSS (``VmHWM``, reset before the phase, :mod:`components.planning.memory`)
minus the RSS just before the phase, in MiB: the memory the phase added, which also counts the
pages of memory-mapped files the process touched. ``anon``/``file`` split the RSS at the end of
the phase (``RssAnon``, ``RssFile``). Run: ``python bench/export_load.py``.
"""

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import LlamaConfig

from components.checkpoint.export import export_hf
from components.distributed.tp_plan import apply_tp_plan
from components.models import (
    build_causal_lm,
    local_parameter_bytes,
    materialize_pretrained,
    meta_causal_lm,
)
from components.models.families import plan_for
from components.planning.memory import current_memory_gib, reset_peak_memory
from components.runtime.launch import launch_local

MIB = 2**20


def config_of(hidden: int, layers: int) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=4 * hidden,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=32000,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _measured(action) -> dict[str, float]:
    """Run ``action``; what it added to the RSS at its peak, and the RSS split after it."""
    dist.barrier()
    before = current_memory_gib("cpu") * 1024
    reset_peak_memory("cpu")
    started = time.perf_counter()
    action()
    seconds = time.perf_counter() - started
    peak = _status_mib("VmHWM")
    dist.barrier()
    return {
        "peak_added": peak - before,
        "anon": _status_mib("RssAnon"),
        "file": _status_mib("RssFile"),
        "seconds": seconds,
    }


def _gathered_export(model, folder: Path) -> None:
    """The export before it was parallel: everything gathered to rank 0, which writes it."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    if dist.get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
        split = split_torch_state_dict_into_shards(state, max_shard_size="5GB")
        for filename, names in split.filename_to_tensors.items():
            save_file({name: state[name].contiguous() for name in names}, folder / filename)
    del state


def _save_source(folder: str, hidden: int, layers: int) -> None:
    build_causal_lm(config_of(hidden, layers), seed=0).save_pretrained(folder)


def _rank(root: str, source: str, hidden: int, layers: int, phase: str) -> dict:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    from torch.distributed.device_mesh import init_device_mesh

    config = config_of(hidden, layers)
    model = meta_causal_lm(config)
    if world > 1:
        tp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        apply_tp_plan(model, tp_mesh, plan_for(config), config)
    if phase == "load":
        result = _measured(lambda: materialize_pretrained(model, source))
    else:
        materialize_pretrained(model, source)
        out = Path(root) / f"{phase}-{world}"
        if phase == "export parallel":
            result = _measured(lambda: export_hf(model, config, out))
        else:
            result = _measured(lambda: _gathered_export(model, out))
    result["shard"] = local_parameter_bytes(model) / MIB
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    dist.destroy_process_group()
    return gathered


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    phases = ["load", "export gathered", "export parallel"]
    parser.add_argument("--phases", nargs="+", default=phases)
    arguments = parser.parse_args()
    print(f"load average at start: {os.getloadavg()}")
    root = tempfile.mkdtemp(prefix="export-load-")
    source = str(Path(root) / "source")
    try:
        launch_local(_save_source, 1, source, arguments.hidden, arguments.layers)
        model_mib = sum(path.stat().st_size for path in Path(source).glob("*.safetensors")) / MIB
        shape = f"Llama hidden {arguments.hidden} x {arguments.layers} layers"
        print(f"{shape}: {model_mib:.0f} MiB of fp32 weights")
        print("| phase | tp | rank | shard MiB | peak added MiB | x shard | anon / file MiB | s |")
        print("|---|---|---|---|---|---|---|---|")
        for tp in arguments.tp:
            for phase in arguments.phases:
                shape = (arguments.hidden, arguments.layers)
                ranks = launch_local(_rank, tp, root, source, *shape, phase)[0]
                for rank, r in enumerate(ranks):
                    print(
                        f"| {phase} | {tp} | {rank} | {r['shard']:.0f} | {r['peak_added']:.0f} | "
                        f"{r['peak_added'] / r['shard']:.2f} | {r['anon']:.0f} / {r['file']:.0f} | "
                        f"{r['seconds']:.2f} |",
                        flush=True,
                    )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
