"""Where a CPU step's RSS goes beyond its live bytes (docs/benchmarks-history.md section 20).

A one-process training step of ``bench/memory_model.py``'s shape (transformers' Llama, AdamW,
checkpointing ``none`` or ``full``) with glibc's heap read after every decoder layer's forward and
backward (``mallinfo2``: the arena, its free bytes, the mapped bytes), and each step's peak RSS,
CPU seconds and minor faults (``getrusage``). Under ``shim.so`` (``LD_PRELOAD``, ``SHIM_OUT``) it
marks each step in the malloc log, which ``replay`` plays through glibc again:

    gcc -O2 -shared -fPIC -o /tmp/shim.so bench/malloc_trace/shim.c -ldl -lpthread
    gcc -O2 -o /tmp/replay bench/malloc_trace/replay.c
    LD_PRELOAD=/tmp/shim.so SHIM_OUT=/tmp/trace.bin OMP_NUM_THREADS=1 \\
        .venv/bin/python bench/malloc_trace/run.py full 4
    /tmp/replay /tmp/trace.bin [MIN_BYTES]    # GLIBC_TUNABLES=... to try a setting
"""

import ctypes
import os
import resource
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

GIB = 1024**3
FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in FIELDS.split()]


LIBC = ctypes.CDLL("libc.so.6")
LIBC.mallinfo2.restype = MallInfo2
SHIM = ctypes.CDLL(None) if os.environ.get("SHIM_OUT") else None


def _status_gib(field: str) -> float:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field))
    return int(line.split()[1]) / 1024**2


def heap(tag: str, rows: list) -> None:
    info = LIBC.mallinfo2()
    rows.append((tag, _status_gib("VmRSS"), info.arena, info.fordblks, info.hblkhd))


def model(checkpointing: str) -> LlamaForCausalLM:
    config = LlamaConfig(
        hidden_size=768, num_hidden_layers=8, intermediate_size=2048, num_attention_heads=12,
        num_key_value_heads=4, head_dim=64, max_position_embeddings=1024, vocab_size=384,
    )  # fmt: skip
    built = LlamaForCausalLM(config)
    if checkpointing == "full":
        built.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return built.train()


def main() -> None:
    checkpointing, steps = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(0)
    llama, rows = model(checkpointing), []
    optimizer = torch.optim.AdamW(llama.parameters(), lr=1e-4)
    ids = torch.randint(0, 384, (4, 1024))
    for index, layer in enumerate(llama.model.layers):
        layer.register_forward_hook(lambda *_, i=index: heap(f"forward {i}", rows))
        layer.register_full_backward_hook(lambda *_, i=index: heap(f"backward {i}", rows))
    for step in range(1, steps + 1):
        rows.clear()
        if SHIM:
            SHIM.shim_mark(step)
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # VmHWM from here
        before = resource.getrusage(resource.RUSAGE_SELF)
        optimizer.zero_grad(set_to_none=True)
        llama(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        after = resource.getrusage(resource.RUSAGE_SELF)
        user, system = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
        tag, rss, arena, free, mapped = max(rows, key=lambda row: row[1])
        print(
            f"step {step}: peak RSS {_status_gib('VmHWM'):.3f} GiB, CPU {user:.2f} + "
            f"{system:.2f} s, {after.ru_minflt - before.ru_minflt} faults; at {tag}: heap "
            f"{arena / GIB:.3f} "
            f"(free {free / GIB:.3f}), mapped {mapped / GIB:.3f}",
            flush=True,
        )
    if SHIM:
        SHIM.shim_mark(99)
        SHIM.shim_flush()


if __name__ == "__main__":
    main()
