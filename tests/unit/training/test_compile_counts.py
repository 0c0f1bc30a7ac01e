"""Dynamo's counters around training steps: a graph break in the first step and a recompilation in
a later one each give one ``note:`` line, once; clean steps give none. Real ``torch.compile``
(backend ``eager``: Dynamo alone) on a function with a real break, a real guard failure."""

import torch

from components.training.compile_counts import CompileCounts


def _broken(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    torch._dynamo.graph_break()
    return y + 1


def _whole(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * 2


def test_a_graph_break_in_the_first_step_is_one_note_said_once():
    torch._dynamo.reset()
    compiled = torch.compile(_broken, backend="eager", dynamic=False)
    counts = CompileCounts.start()
    for step in (1, 2):
        with counts.step(step):
            compiled(torch.ones(3))
        notes = counts.notes()
        if step == 1:
            assert len(notes) == 1
            assert notes[0].startswith("note: train.compile: Dynamo counted 1 graph break(s)")
            assert "graph_break()" in notes[0]  # the reason's first line
        else:
            assert notes == []  # said once
    assert counts.recompiled == 0


def test_a_recompilation_after_the_first_step_is_one_note():
    torch._dynamo.reset()
    compiled = torch.compile(_whole, backend="eager", dynamic=False)
    counts = CompileCounts.start()
    with counts.step(1):
        compiled(torch.ones(3))
    assert counts.notes() == []  # the first step compiles: no break, nothing to say
    with counts.step(2):
        compiled(torch.ones(3))  # the same guards: no compilation
    assert counts.notes() == []
    with counts.step(3):
        compiled(torch.ones(5))  # a new shape fails a guard
    assert counts.breaks == 0
    assert counts.recompiled == 1
    assert counts.notes() == [
        "note: train.compile: Dynamo compiled 1 frame(s) again from step 3 on (a guard failed "
        "after the first step): TORCH_LOGS=recompiles shows why"
    ]
