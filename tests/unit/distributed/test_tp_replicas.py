"""tp_replicas pieces that need no process group: markers, iteration order, chunking, dtypes."""

import pytest
import torch
from torch import nn

from components.distributed import tp_replicas
from components.distributed.tp_replicas import (
    _MODEL_OWNED_GRAD_DIVISOR_ATTR,
    _TP_REPLICA_GRAD_REDUCTION_ATTR,
    _get_tp_mesh,
    _gradient_chunks,
    _gradient_reduce_dtype,
    _iter_unique_buffers,
    _iter_unique_parameters,
    _iter_unique_parameters_by_name,
    _local_tensor,
    exclude_from_tp_replica_sync,
    mark_tp_replica_gradient_reduction,
)


def test_constants_are_the_api_values():
    assert tp_replicas._MAX_FLAT_BUFFER_BYTES == 268435456
    assert _TP_REPLICA_GRAD_REDUCTION_ATTR == "_nemo_tp_replica_grad_reduction"
    assert _MODEL_OWNED_GRAD_DIVISOR_ATTR == "_nemo_model_owned_grad_divisor"


def test_mark_stores_the_reduction_on_the_module_and_rejects_others():
    norm = nn.LayerNorm(4)
    mark_tp_replica_gradient_reduction(norm, "sum")
    assert getattr(norm, _TP_REPLICA_GRAD_REDUCTION_ATTR) == "sum"
    with pytest.raises(ValueError, match="'mean' or 'sum', got 'avg'"):
        mark_tp_replica_gradient_reduction(norm, "avg")
    assert getattr(norm, _TP_REPLICA_GRAD_REDUCTION_ATTR) == "sum"


def test_mark_applies_to_direct_parameters_only():
    outer = nn.Sequential(nn.LayerNorm(2), nn.LayerNorm(3))
    outer.register_parameter("scale", nn.Parameter(torch.ones(1)))
    mark_tp_replica_gradient_reduction(outer, "sum")
    reductions = {tuple(p.shape): r for p, r in _iter_unique_parameters([outer])}
    assert reductions == {(1,): "sum", (2,): "mean", (3,): "mean"}


def test_marker_survives_parameter_replacement():
    norm = nn.LayerNorm(4)
    mark_tp_replica_gradient_reduction(norm, "sum")
    norm.weight = nn.Parameter(torch.zeros(4, dtype=torch.float64))
    assert ("sum", torch.float64) in {(r, p.dtype) for p, r in _iter_unique_parameters([norm])}


def test_exclude_marks_the_whole_subtree_and_hides_its_parameters_and_buffers():
    model = nn.Module()
    model.router = nn.Linear(2, 2, bias=False)
    model.experts = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    exclude_from_tp_replica_sync(model.experts)
    assert all(
        getattr(m, _TP_REPLICA_GRAD_REDUCTION_ATTR) == "skip" for m in model.experts.modules()
    )
    assert [p for p, _ in _iter_unique_parameters([model])] == [model.router.weight]
    assert list(_iter_unique_buffers([model])) == []


def test_model_owned_parameter_is_skipped():
    model = nn.Sequential(nn.Linear(2, 2, bias=False), nn.Linear(2, 2, bias=False))
    setattr(model[1].weight, _MODEL_OWNED_GRAD_DIVISOR_ATTR, 4)
    assert [p for p, _ in _iter_unique_parameters_by_name([model])] == [model[0].weight]


def build_in_order(names: list[str]) -> nn.Module:
    model = nn.Module()
    for name in names:
        module = nn.Linear(len(name), 1, bias=False)
        module.register_buffer("stat", torch.zeros(len(name)))
        setattr(model, name, module)
    return model


def test_by_name_order_does_not_depend_on_registration_order():
    names = ["zeta", "alpha", "mu", "b"]
    forward, backward = build_in_order(names), build_in_order(names[::-1])
    registration = [p.shape[1] for p, _ in _iter_unique_parameters([forward])]
    assert registration == [4, 5, 2, 1]  # registration order, as documented
    for model in (forward, backward):
        assert [p.shape[1] for p, _ in _iter_unique_parameters_by_name([model])] == [5, 1, 2, 4]
        assert [b.numel() for b in _iter_unique_buffers([model])] == [5, 1, 2, 4]


def test_model_parts_come_in_part_order_before_name_order():
    first, second = build_in_order(["z"]), build_in_order(["aaa"])
    assert [p.shape[1] for p, _ in _iter_unique_parameters_by_name([first, second])] == [1, 3]


def test_tied_parameter_and_buffer_are_yielded_once():
    model = nn.Module()
    model.embed = nn.Embedding(4, 2)
    model.head = nn.Linear(2, 4, bias=False)
    model.head.weight = model.embed.weight
    model.register_buffer("shared", torch.zeros(1))
    model.head.register_buffer("alias", model.shared)
    assert [p for p, _ in _iter_unique_parameters_by_name([model])] == [model.embed.weight]
    assert list(_iter_unique_buffers([model])) == [model.shared]
    assert [p for p, _ in _iter_unique_parameters_by_name([model, model])] == [model.embed.weight]


def test_tied_parameter_with_conflicting_reductions_names_it():
    model = nn.Module()
    model.embed = nn.Embedding(4, 2)
    model.head = nn.Linear(2, 4, bias=False)
    model.head.weight = model.embed.weight
    mark_tp_replica_gradient_reduction(model.head, "sum")
    with pytest.raises(ValueError, match=r"Shared parameter 'embed.weight' \(also 'head.weight'\)"):
        list(_iter_unique_parameters_by_name([model]))


def sizes_of(chunks: list[list[torch.Tensor]]) -> list[list[int]]:
    return [[t.numel() for t in chunk] for chunk in chunks]


def test_chunks_respect_the_limit_and_keep_every_tensor_once_in_order(monkeypatch):
    monkeypatch.setattr(tp_replicas, "_MAX_FLAT_BUFFER_BYTES", 40)
    gradients = [torch.zeros(n) for n in (4, 6, 3, 20, 2, 2, 5)]
    chunks = list(_gradient_chunks(gradients))
    assert sizes_of(chunks) == [[4, 6], [3], [20], [2, 2, 5]]
    assert [
        t for chunk in chunks for t in chunk
    ] == gradients  # identity: each tensor once, in order
    assert all(sum(t.numel() * 4 for t in chunk) <= 40 for chunk in chunks if len(chunk) > 1)


def test_low_precision_is_budgeted_at_fp32_size(monkeypatch):
    monkeypatch.setattr(tp_replicas, "_MAX_FLAT_BUFFER_BYTES", 16)
    for dtype in (torch.bfloat16, torch.float16):
        assert sizes_of(_gradient_chunks([torch.zeros(2, 2, dtype=dtype)] * 3)) == [[4], [4], [4]]
    assert sizes_of(_gradient_chunks([torch.zeros(2, 2, dtype=torch.float64)] * 2)) == [[4], [4]]
    assert sizes_of(_gradient_chunks([torch.zeros(2, 2, dtype=torch.float32)] * 2)) == [[4], [4]]
    assert sizes_of(_gradient_chunks([torch.zeros(2, dtype=torch.float32)] * 2)) == [[2, 2]]


def test_oversized_gradient_gets_its_own_chunk(monkeypatch):
    monkeypatch.setattr(tp_replicas, "_MAX_FLAT_BUFFER_BYTES", 8)
    assert sizes_of(_gradient_chunks([torch.zeros(1), torch.zeros(100), torch.zeros(1)])) == [
        [1],
        [100],
        [1],
    ]
    assert list(_gradient_chunks([])) == []


def test_reduce_dtype_upcasts_only_low_precision():
    assert _gradient_reduce_dtype(torch.bfloat16) == torch.float32
    assert _gradient_reduce_dtype(torch.float16) == torch.float32
    assert _gradient_reduce_dtype(torch.float32) == torch.float32
    assert _gradient_reduce_dtype(torch.float64) == torch.float64


def test_plain_tensor_is_its_own_local_storage_and_no_mesh_means_no_tp():
    tensor = torch.ones(2)
    assert _local_tensor(tensor) is tensor
    assert _get_tp_mesh(None, "tp") is None
