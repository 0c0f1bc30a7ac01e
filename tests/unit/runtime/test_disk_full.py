"""A write that fails on a full disk says so on the error line, naming the folder and the
checkpoint that survives (torch's checkpoint writer reports a full disk without the errno)."""

import errno
import shutil
from types import SimpleNamespace

from components.runtime.exit_status import disk_full


def usage(free: int):
    return lambda path: SimpleNamespace(total=100 * 2**30, used=100 * 2**30 - free, free=free)


def test_a_full_disk_without_the_errno_is_named_with_the_checkpoint_kept(tmp_path, monkeypatch):
    (tmp_path / "checkpoints" / "step_00000002").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_00000002" / "COMPLETE").write_text("{}")
    (tmp_path / "checkpoints" / "step_00000004.tmp").mkdir()
    monkeypatch.setattr(shutil, "disk_usage", usage(0))
    line = disk_full(RuntimeError("unexpected pos 704 vs 598"), tmp_path)
    assert line.startswith(f"no space left on device in {tmp_path} (0.0 MiB free)")
    assert "the last complete checkpoint, step_00000002, is kept" in line


def test_enospc_is_named_even_with_space_freed_since(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", usage(2**40))
    try:
        raise OSError(errno.ENOSPC, "No space left on device")
    except OSError as cause:
        try:
            raise RuntimeError("export failed") from cause
        except RuntimeError as error:
            line = disk_full(error, tmp_path)
    assert "no space left on device in" in line and "no checkpoint was written yet" in line


def test_another_failure_with_space_left_is_not_a_full_disk(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", usage(2**40))
    assert disk_full(ValueError("a bug"), tmp_path) is None


def test_after_the_last_steps_checkpoint_it_says_resume_needs_more_steps(tmp_path, monkeypatch):
    """The export failed: resume=auto at the same max_steps would be refused (nothing to train)."""
    (tmp_path / "checkpoints" / "step_00000004").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_00000004" / "COMPLETE").write_text("{}")
    monkeypatch.setattr(shutil, "disk_usage", usage(0))
    line = disk_full(OSError(errno.ENOSPC, "No space left on device"), tmp_path, max_steps=4)
    assert "step_00000004, is of the run's last step but hf/ was not written" in line
    assert "checkpoint.resume=auto with a train.max_steps above 4 trains on from it" in line
    assert "overwrite_output_dir=true trains again" in line
