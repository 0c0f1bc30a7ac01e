"""A restarted attempt sees none of the previous attempt's store keys (``attempt_store``): torch
elastic keeps one store for every attempt of a run, and torch names the default group's keys alike
in each, so a restarted rank could otherwise read the address a dead rank had posted."""

from datetime import timedelta

import torch.distributed as dist

from components.runtime.launch import free_port
from components.runtime.world import attempt_store


def test_each_attempt_sees_only_its_own_keys(monkeypatch):
    port = free_port()
    agent = dist.TCPStore("127.0.0.1", port, 1, is_master=True)  # the agent's, shared by attempts
    environment = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0"}
    environment |= {"WORLD_SIZE": "1", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    stores = []
    for attempt in ("0", "1"):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", attempt)
        store, rank, world_size = attempt_store(timedelta(seconds=5))
        assert (rank, world_size) == (0, 1)
        stores.append(store)
    stores[0].set("default_pg/0//cpu//rank_1", "127.0.0.1:1234")  # a peer's address, attempt 0
    assert stores[0].check(["default_pg/0//cpu//rank_1"])
    assert not stores[1].check(["default_pg/0//cpu//rank_1"])  # the restart waits for a fresh one
    assert agent.num_keys() >= 1
