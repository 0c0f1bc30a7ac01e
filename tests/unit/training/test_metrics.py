"""MetricsLog: lines for skipped steps (grad_norm None), optional tokens and peak memory, missing
values, resume."""

import json

from components.training.metrics import MetricsLog, format_record


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
    assert "step     1  loss 2.5000  grad_norm -  skipped (non-finite grad norm)" in out
    assert "step    10  loss -  grad_norm -  skipped (non-finite grad norm)" in out


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
