"""A run's state is one named set (components/checkpoint/state.py): a checkpoint of it, resumed
into a freshly built one, gives every part back: weights, optimizer moments, the schedule's
position, the step (the data position) and a router's routing bias."""

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from components.checkpoint.state import TrainState
from components.checkpoint.writer import CheckpointWriter
from components.runtime.checkpoints import resume
from tests.unit.checkpoint.test_writer_stager import step, world  # noqa: F401 - the fixture


def built(seed: int) -> TrainState:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    model[2].register_buffer("routing_bias", torch.zeros(4))  # as RoutingBias registers it
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return TrainState(
        model=model, optimizer=optimizer, schedule=LambdaLR(optimizer, lambda s: 0.9**s)
    )


def test_a_resumed_state_is_the_saved_one_part_by_part(tmp_path, world):  # noqa: F811
    saved = built(seed=0)
    for done in (1, 2, 3):
        step(saved.model, saved.optimizer)
        saved.schedule.step()
        saved.model[2].routing_bias += done  # the bias moves at each step's end
        saved.step = done
    writer = CheckpointWriter(tmp_path, keep=None, run_id="run", run_info=None, asynchronous=False)
    writer.save(saved)
    writer.close()
    restored = built(seed=1)
    resume(writer.last_path, restored)
    assert restored.step == restored.data_position == 3
    assert torch.equal(restored.routing_bias["2.routing_bias"], torch.full((4,), 6.0))
    assert restored.routing_bias.keys() == saved.routing_bias.keys() == {"2.routing_bias"}
    for mine, theirs in zip(saved.model.parameters(), restored.model.parameters(), strict=True):
        assert torch.equal(mine, theirs)
        moments = saved.optimizer.state[mine], restored.optimizer.state[theirs]
        assert torch.equal(moments[0]["exp_avg_sq"], moments[1]["exp_avg_sq"])
    assert restored.schedule.last_epoch == 3
    assert restored.schedule.get_last_lr() == saved.schedule.get_last_lr()
