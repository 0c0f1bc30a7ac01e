"""Per-step metrics: one JSON line per optimizer step, a progress bar on rank 0, and a loss-curve PNG."""

import json
from pathlib import Path

from tqdm import tqdm


class MetricsLog:
    """Appends one flushed JSON object per step to ``metrics.jsonl``; silent on every rank but the writer."""

    def __init__(self, path: Path, writer: bool, first_step: int, max_steps: int):
        self.path = path
        self.writer = writer
        self._file = None
        self._bar = None
        if writer:
            path.parent.mkdir(parents=True, exist_ok=True)
            # On resume keep the lines up to the checkpoint's step: a killed run may have logged past it.
            kept = _lines_up_to(path, first_step) if first_step > 0 and path.exists() else []
            self._file = path.open("w")
            self._file.writelines(line + "\n" for line in kept)
            self._file.flush()
            self._bar = tqdm(total=max_steps, initial=first_step, unit="step", dynamic_ncols=True)

    def log(self, record: dict) -> None:
        if not self.writer:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        self._bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
        self._bar.update(1)
        if "val_loss" in record or record["step"] == 1 or record["step"] % 10 == 0:
            line = f"step {record['step']:>5}  loss {record['loss']:.4f}  grad_norm {record['grad_norm']:.3f}"
            if "val_loss" in record:
                line += f"  val_loss {record['val_loss']:.4f}"
            self._bar.write(line)

    def close(self) -> None:
        if self.writer:
            self._bar.close()
            self._file.close()


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
        axes.plot([r["step"] for r in validation], [r["val_loss"] for r in validation], "o-", label="validation loss")
    axes.set_xlabel("step")
    axes.set_ylabel("loss (nats/token)")
    axes.legend()
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(png_path, dpi=100)
    plt.close(figure)
