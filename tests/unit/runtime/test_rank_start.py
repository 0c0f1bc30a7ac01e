"""A local rank reaches the launcher's store only once every local rank of its attempt has been
forked (``_wait_until_every_local_rank_started``): a rank forked while the launcher's store thread
held glibc's resolver lock blocked for good in its first address lookup. A marker of an earlier
attempt (a restart) does not count."""

import threading
import time

from components.runtime.launch import _wait_until_every_local_rank_started


def test_a_rank_waits_for_every_local_rank_of_its_own_attempt(tmp_path, monkeypatch):
    environment = {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": "1"}
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    (tmp_path / "1.started.0").write_text("")  # rank 1 of the failed first attempt
    waiting = threading.Thread(target=_wait_until_every_local_rank_started, args=(tmp_path,))
    waiting.start()
    noted = tmp_path / "0.started.1"  # this rank notes itself first
    deadline = time.monotonic() + 60
    while not noted.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert noted.exists()
    waiting.join(timeout=0.5)
    assert waiting.is_alive()  # rank 1 of this attempt has not started
    (tmp_path / "1.started.1").write_text("")
    waiting.join(timeout=60)
    assert not waiting.is_alive()
