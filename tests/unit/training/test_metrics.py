"""MetricsLog: lines for skipped steps (grad_norm None), optional tokens and peak memory, missing
values, resume; a plain line per step in a log, a progress bar on a terminal; the summary."""

import json
import math

import pytest

from components.training.metrics import (
    MetricsLog,
    format_record,
    loss_figure,
    plot_loss_curve,
    summary_line,
)


def test_a_skipped_step_with_no_grad_norm_is_logged_and_printed(tmp_path, capsys):
    log = MetricsLog(tmp_path / "metrics.jsonl", writer=True, first_step=0, max_steps=20)
    records = [
        {
            "step": 1,
            "loss": 2.5,
            "grad_norm": None,
            "lr": 1e-3,
            "tokens_per_s": 100.0,
            "skipped": True,
        },
        {"step": 2, "loss": 2.25, "grad_norm": 0.5, "lr": 1e-3, "tokens_per_s": None},
        {
            "step": 10,
            "loss": None,
            "grad_norm": None,
            "lr": 1e-3,
            "tokens_per_s": 120.0,
            "skipped": True,
        },
    ]
    for record in records:
        log.log(record)
    log.close()
    written = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert written == records
    printed = capsys.readouterr()
    out = printed.out + printed.err
    skipped = "skipped (non-finite grad norm)"
    assert f"step     1  loss 2.5000  lr 1.00e-03  grad_norm -  tok/s 100  {skipped}" in out
    assert f"step    10  loss -  lr 1.00e-03  grad_norm -  tok/s 120  {skipped}" in out


def test_tokens_and_peak_memory_are_shown_when_present():
    record = {
        "step": 20,
        "loss": 1.0,
        "grad_norm": 0.25,
        "val_loss": 1.5,
        "tokens": 12288,
        "peak_memory_gib": 3.456,
    }
    assert format_record(record) == (
        "step    20  loss 1.0000  grad_norm 0.250  val_loss 1.5000  tokens 12,288  peak_mem 3.46 "
        "GiB"
    )
    record |= {"lr": 2.5e-4, "tokens_per_s": 12345.6}
    assert format_record(record) == (
        "step    20  loss 1.0000  lr 2.50e-04  grad_norm 0.250  tok/s 12,346  val_loss 1.5000  "
        "tokens 12,288  peak_mem 3.46 GiB"
    )
    assert format_record({"step": 3}) == "step     3"
    assert (
        format_record({"step": 4, "loss": "nan?", "tokens": None})
        == "step     4  loss nan?  tokens -"
    )


def test_a_resume_keeps_the_lines_up_to_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        "".join(json.dumps({"step": step, "loss": 1.0}) + "\n" for step in range(1, 6))
        + '{"step": 6, "lo'
    )
    MetricsLog(path, writer=True, first_step=3, max_steps=10).close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]
    MetricsLog(tmp_path / "other.jsonl", writer=False, first_step=0, max_steps=10).log(
        {"step": 1}
    )  # silent
    assert not (tmp_path / "other.jsonl").exists()


STEPS = [{"step": step, "loss": 3.0 - step / 10, "lr": 1e-3, "grad_norm": 0.5} for step in (1, 2)]


@pytest.mark.parametrize("terminal", [False, True])
def test_a_log_gets_a_plain_line_per_step_and_a_terminal_a_bar(tmp_path, capsys, terminal):
    log = MetricsLog(tmp_path / "metrics.jsonl", writer=True, first_step=0, max_steps=2,
                     terminal=terminal)  # fmt: skip
    for record in STEPS:
        log.log(record)
    log.close()
    printed = capsys.readouterr()
    lines = printed.out.splitlines()
    assert [line for line in lines if line.startswith("step ")] == (
        [format_record(record) for record in STEPS] if not terminal else [format_record(STEPS[0])]
    )
    assert ("\r" in printed.err) == terminal  # the bar, on a terminal only
    assert lines[-1].startswith("summary: steps 1-2 of 2, 0 tokens in ")


def test_the_summary_counts_this_runs_steps_and_losses_and_every_validation_loss():
    records = [
        {"step": 1, "loss": 5.0, "tokens": 100},
        {"step": 2, "loss": 4.0, "tokens": 100, "val_loss": 3.5},  # before the resume
        {"step": 3, "loss": 3.0, "tokens": 120},
        {"step": 4, "loss": 2.5, "tokens": 130, "val_loss": 3.75},
    ]
    assert summary_line(records, 2, 10, 2.0) == (
        "summary: steps 3-4 of 10, 250 tokens in 2.0 s (125 tokens/s); loss 3.0000 -> 2.5000; "
        "val_loss 3.7500 at step 4, best 3.5000 at step 2"
    )
    alone = summary_line(records[:1], 0, 1, 0.5)
    assert alone.endswith("loss 5.0000 -> 5.0000; no validation loss")
    assert summary_line(records[:2], 2, 10, 1.0) == ""  # resumed at the end: no step trained


def test_a_resumed_log_summarises_the_kept_steps_validation_too(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "loss": 4.0, "val_loss": 2.0}) + "\n")
    log = MetricsLog(path, writer=True, first_step=1, max_steps=2, terminal=False)
    log.log({"step": 2, "loss": 3.0, "tokens": 7, "val_loss": 2.5})
    log.close()
    (summary,) = [line for line in capsys.readouterr().out.splitlines() if "summary" in line]
    assert summary.startswith("summary: steps 2-2 of 2, 7 tokens in ")
    best = "best 2.0000 at step 1"
    assert summary.endswith(f"loss 3.0000 -> 3.0000; val_loss 2.5000 at step 2, {best}")


def test_the_loss_plot_has_its_title_the_learning_rate_and_the_grad_norm(tmp_path):
    from PIL import Image

    records = [
        {"step": 1, "loss": 5.0, "lr": 1e-3, "grad_norm": 2.0},
        {"step": 2, "loss": 4.0, "lr": 2e-3, "grad_norm": None, "skipped": True},
        {"step": 3, "loss": 3.0, "lr": 3e-3, "grad_norm": 1.5, "val_loss": 3.25},
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    plot_loss_curve(path, tmp_path / "loss.png", "llama, tp=2, 3 steps: run")
    assert Image.open(tmp_path / "loss.png").info["Title"] == "llama, tp=2, 3 steps: run"
    figure = loss_figure(records, "llama, tp=2, 3 steps: run")
    assert figure._suptitle.get_text() == "llama, tp=2, 3 steps: run"
    curves = {line.get_label(): line for axes in figure.axes for line in axes.get_lines()}
    assert sorted(curves) == ["grad norm", "learning rate", "train loss", "validation loss"]
    assert list(curves["learning rate"].get_ydata()) == [1e-3, 2e-3, 3e-3]
    norm = list(curves["grad norm"].get_ydata())
    assert norm[0] == 2.0 and math.isnan(norm[1]) and norm[2] == 1.5  # skipped: no point
    assert list(curves["validation loss"].get_xdata()) == [3]
