"""Per-step metrics: one JSON line per optimizer step; on rank 0 a progress bar on a terminal, or a
plain line per step in a log (a file, a pipe); a summary line at the end; and a loss-curve PNG."""

import json
import math
import sys
import time
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
    writer. The writer shows the steps on stdout: with a progress bar when stderr is a terminal
    (``terminal``; the bar is drawn there), else a plain line per step, so that a log written to a
    file or a pipe reads line by line; :meth:`close` prints the run's summary."""

    def __init__(
        self,
        path: Path,
        writer: bool,
        first_step: int,
        max_steps: int,
        terminal: bool | None = None,
    ):
        self.path = path
        self.writer = writer
        self.max_steps = max_steps
        self._file = None
        self._bar = None
        self._records: list[dict] = []  # every step's record, those kept from before a resume too
        self._first_step, self._started = first_step, time.perf_counter()
        if writer:
            path.parent.mkdir(parents=True, exist_ok=True)
            # On resume keep the lines up to the checkpoint's step: a killed run may have logged
            # past it.
            kept = _lines_up_to(path, first_step) if first_step > 0 and path.exists() else []
            self._records = [json.loads(line) for line in kept]
            self._file = path.open("w")
            self._file.writelines(line + "\n" for line in kept)
            self._file.flush()
            if sys.stderr.isatty() if terminal is None else terminal:
                self._bar = tqdm(
                    total=max_steps, initial=first_step, unit="step", dynamic_ncols=True
                )

    def log(self, record: dict) -> None:
        """Write ``record`` (needs ``step``; every other value may be missing or None) and show it:
        on a terminal the bar's postfix every step, a printed line on step 1, every tenth step,
        validation and skipped steps; in a log a printed line every step."""
        if not self.writer:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        self._records.append(record)
        if self._bar is None:
            print(format_record(record), flush=True)
            return
        self._bar.set_postfix(
            loss=_shown(record.get("loss"), ".4f"), tok_s=_shown(record.get("tokens_per_s"), ".0f")
        )
        self._bar.update(1)
        step = record["step"]
        if "val_loss" in record or record.get("skipped") or step == 1 or step % 10 == 0:
            self._bar.write(format_record(record))

    def close(self) -> None:
        """Close the file (and the bar), then print the summary of the steps this run trained."""
        if not self.writer:
            return
        if self._bar is not None:
            self._bar.close()
        self._file.close()
        seconds = time.perf_counter() - self._started
        if line := summary_line(self._records, self._first_step, self.max_steps, seconds):
            print(line, flush=True)


def summary_line(records: list[dict], first_step: int, max_steps: int, seconds: float) -> str:
    """The run's ``summary:`` line: the steps trained now (after ``first_step``, of
    ``max_steps``), their tokens and ``seconds``, the training loss from the first of those steps
    to the last (a resumed run's from its own first step), and the last and best validation loss
    of every step logged (a resumed run's earlier steps too, each with its step); "" when this run
    trained no step."""
    trained = [record for record in records if record["step"] > first_step]
    if not trained:
        return ""
    steps = f"steps {trained[0]['step']}-{trained[-1]['step']} of {max_steps}"
    tokens = sum(record.get("tokens") or 0 for record in trained)
    rate = f" ({tokens / seconds:,.0f} tokens/s)" if seconds > 0 else ""
    first, last = (_shown(record.get("loss"), ".4f") for record in (trained[0], trained[-1]))
    line = f"summary: {steps}, {tokens:,} tokens in {seconds:.1f} s{rate}; loss {first} -> {last}"
    validated = [record for record in records if record.get("val_loss") is not None]
    if not validated:
        return f"{line}; no validation loss"
    best = min(validated, key=lambda record: record["val_loss"])
    return (
        f"{line}; val_loss {validated[-1]['val_loss']:.4f} at step {validated[-1]['step']}, "
        f"best {best['val_loss']:.4f} at step {best['step']}"
    )


# (key, label, format) of the values a printed line shows, in order, when the record has them.
_LINE_FIELDS = (
    ("loss", "loss", ".4f"),
    ("lr", "lr", ".2e"),
    ("grad_norm", "grad_norm", ".3f"),
    ("tokens_per_s", "tok/s", ",.0f"),
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
    """The printed line of one step: ``step``, then loss, lr, grad_norm, tokens/s, val_loss, tokens
    and peak memory (GiB) for those present (None shows as ``-``), and ``skipped`` for a skipped
    update."""
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


def last_logged_step(path: Path) -> int:
    """The last step ``metrics.jsonl`` at ``path`` holds a complete line of; 0 for none."""
    if not path.is_file():
        return 0
    return max((json.loads(line)["step"] for line in _lines_up_to(path, math.inf)), default=0)


def plot_loss_curve(metrics_path: Path, png_path: Path, title: str) -> None:
    """Draw ``metrics.jsonl``'s curves against step (:func:`loss_figure`) into ``png_path``, whose
    PNG ``Title`` is ``title`` too."""
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    figure = loss_figure(records, title)
    figure.savefig(png_path, dpi=100, metadata={"Title": title})
    plt.close(figure)


def loss_figure(records: list[dict], title: str):
    """A figure titled ``title``: above, the training (and validation) loss; below, the learning
    rate (left axis) and the grad norm (right axis; a skipped step's is missing)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (losses, rates) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(2, 1))
    figure.suptitle(title)
    steps = [r["step"] for r in records]
    losses.plot(steps, [r["loss"] for r in records], label="train loss")
    validation = [r for r in records if r.get("val_loss") is not None]
    if validation:
        at = [r["step"] for r in validation]
        losses.plot(at, [r["val_loss"] for r in validation], "o-", label="validation loss")
    losses.set_ylabel("loss (nats/token)")
    losses.legend()
    losses.grid(alpha=0.3)
    rates.plot(steps, [r.get("lr") for r in records], color="tab:green", label="learning rate")
    rates.set_ylabel("learning rate")
    rates.set_xlabel("step")
    rates.grid(alpha=0.3)
    norms = rates.twinx()
    norm = [r.get("grad_norm") for r in records]
    norms.plot(steps, [n if n is not None else float("nan") for n in norm], color="tab:red",
               label="grad norm")  # fmt: skip
    norms.set_ylabel("grad norm")
    handles = [*rates.get_lines(), *norms.get_lines()]
    rates.legend(handles, [line.get_label() for line in handles], loc="upper right")
    for axes in (losses, rates):  # steps are whole: no 0.25-step ticks, and fewer to draw
        axes.xaxis.get_major_locator().set_params(integer=True)  # AutoLocator: a MaxNLocator
    # Fixed margins, not tight_layout: that draws the figure once more to measure it, 40% of the
    # plot's time, paid at the end of every run.
    figure.subplots_adjust(left=0.14, right=0.86, top=0.92, bottom=0.09, hspace=0.12)
    return figure
