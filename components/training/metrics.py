"""Per-step metrics: one JSON line per optimizer step, a progress bar on rank 0, and a loss-curve
PNG."""

import json
from pathlib import Path

from tqdm import tqdm

from components.planning.flops import peak_tflops


def matmul_math(precision: str, tf32: bool) -> str:
    """What the matmuls of ``train.precision`` compute in on CUDA: ``bf16`` (bf16-mixed, bf16),
    ``tf32`` (fp32 with ``train.tf32``) or ``fp32``; MFU divides by that math's peak."""
    if precision != "fp32":
        return "bf16"
    return "tf32" if tf32 else "fp32"


def throughput(
    tokens: int, seconds: float, flops: float | None, world: int, device, math: str = "bf16"
) -> dict[str, float]:
    """``tokens_per_s``; ``tflops``, the model TFLOP/s per rank: ``flops`` per token × the step's
    ``tokens`` (the whole world's) / ``seconds`` / ``world`` (ranks), unless ``flops`` is None
    (unknown for the model); and, where the device's peak for the matmuls' ``math`` is known
    (CUDA, ``components.planning.flops.PEAKS``), ``mfu``: tflops / peak."""
    if flops is None:
        return {"tokens_per_s": tokens / seconds}
    tflops = flops * tokens / seconds / world / 1e12
    peak = peak_tflops(device, math)
    mfu = {"mfu": tflops / peak} if peak else {}
    return {"tokens_per_s": tokens / seconds, "tflops": tflops, **mfu}


class MetricsLog:
    """Appends one flushed JSON object per step to ``metrics.jsonl``; silent on every rank but the
    writer."""

    def __init__(self, path: Path, writer: bool, first_step: int, max_steps: int):
        self.path = path
        self.writer = writer
        self._file = None
        self._bar = None
        if writer:
            path.parent.mkdir(parents=True, exist_ok=True)
            # On resume keep the lines up to the checkpoint's step: a killed run may have logged
            # past it.
            kept = _lines_up_to(path, first_step) if first_step > 0 and path.exists() else []
            self._file = path.open("w")
            self._file.writelines(line + "\n" for line in kept)
            self._file.flush()
            self._bar = tqdm(total=max_steps, initial=first_step, unit="step", dynamic_ncols=True)

    def log(self, record: dict) -> None:
        """Write ``record`` (needs ``step``; every other value may be missing or None) and show it:
        the bar's postfix every step, a printed line on step 1, every tenth step, validation and
        skipped steps."""
        if not self.writer:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        self._bar.set_postfix(
            loss=_shown(record.get("loss"), ".4f"), tok_s=_shown(record.get("tokens_per_s"), ".0f")
        )
        self._bar.update(1)
        step = record["step"]
        if "val_loss" in record or record.get("skipped") or step == 1 or step % 10 == 0:
            self._bar.write(format_record(record))

    def close(self) -> None:
        if self.writer:
            self._bar.close()
            self._file.close()


# (key, label, format) of the values a printed line shows, in order, when the record has them.
_LINE_FIELDS = (
    ("loss", "loss", ".4f"),
    ("grad_norm", "grad_norm", ".3f"),
    ("val_loss", "val_loss", ".4f"),
    ("tokens", "tokens", ",d"),
    ("peak_memory_gib", "peak_mem", ".2f"),
)


def _shown(value: object, spec: str) -> str:
    """``value`` formatted with ``spec``; ``-`` for None, plain ``str`` for what the spec does not
    fit."""
    if value is None:
        return "-"
    try:
        return format(value, spec)
    except (TypeError, ValueError):
        return str(value)


def format_record(record: dict) -> str:
    """The printed line of one step: ``step``, then loss, grad_norm, val_loss, tokens and peak
    memory (GiB) for those present (None shows as ``-``), and ``skipped`` for a skipped update."""
    line = f"step {record.get('step', '?'):>5}"
    for key, label, spec in _LINE_FIELDS:
        if key in record:
            line += f"  {label} {_shown(record[key], spec)}" + (
                " GiB" if key == "peak_memory_gib" else ""
            )
    if record.get("skipped"):
        line += "  skipped (non-finite grad norm)"
    return line


def _lines_up_to(path: Path, step: int) -> list[str]:
    """Complete lines with ``step`` at most ``step`` (a killed run may also have died mid-line)."""
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue
    return kept


def plot_loss_curve(metrics_path: Path, png_path: Path) -> None:
    """Draw training (and validation) loss against step from ``metrics.jsonl``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    figure, axes = plt.subplots(figsize=(6, 4))
    axes.plot([r["step"] for r in records], [r["loss"] for r in records], label="train loss")
    validation = [r for r in records if "val_loss" in r]
    if validation:
        axes.plot(
            [r["step"] for r in validation],
            [r["val_loss"] for r in validation],
            "o-",
            label="validation loss",
        )
    axes.set_xlabel("step")
    axes.set_ylabel("loss (nats/token)")
    axes.legend()
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(png_path, dpi=100)
    plt.close(figure)
