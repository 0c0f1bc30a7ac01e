"""The sync's pieces without a process group: the structural fingerprint and the buffer budget."""

import pytest
import torch
from torch import nn

from components.distributed.replicas.buckets import BucketLayout
from components.distributed.replicas.flat_buffers import (
    bounded_chunks,
    flat_views,
    pack,
    unpack,
    wire_dtype,
)
from components.distributed.replicas.plan import _Fingerprint
from components.distributed.replicas.selection import REDUCTION_ATTR


def two_layers() -> nn.Module:
    return nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.LayerNorm(2)))


def fingerprint(model: nn.Module) -> _Fingerprint:
    trainable = [p for p in model.parameters() if p.requires_grad]
    return _Fingerprint([model], trainable, [p for p in model.parameters() if not p.requires_grad])


def holds(print_: _Fingerprint) -> bool:
    return print_.same_structure() and print_.still_trainable()


@pytest.mark.parametrize(
    "change",
    [
        lambda m: setattr(m[0], "weight", nn.Parameter(torch.zeros(2, 2))),
        lambda m: m[0]._parameters.__setitem__("bias", nn.Parameter(torch.zeros(2))),
        lambda m: m[1].append(nn.Linear(2, 2)),
        lambda m: delattr(m[1], "0"),
        lambda m: m[1]._modules.__setitem__("0", nn.LayerNorm(2)),  # replaced behind setattr
        lambda m: m[1][0].register_parameter("extra", nn.Parameter(torch.zeros(1))),
        lambda m: setattr(m[1][0], REDUCTION_ATTR, "sum"),  # a marker set directly
        lambda m: m[0].weight.requires_grad_(False),
    ],
    ids=[
        "replaced",
        "replaced_in_dict",
        "added",
        "deleted",
        "module_replaced",
        "registered",
        "marker",
        "frozen",
    ],
)
def test_fingerprint_sees_every_structural_change(change):
    model = two_layers()
    print_ = fingerprint(model)
    assert holds(print_)
    model[0].weight.grad = torch.ones(2, 2)  # gradients and values may change freely
    model[0].weight.data.add_(1)
    nn.Linear(3, 3)  # and modules built elsewhere do not matter
    assert holds(print_)
    change(model)
    assert not holds(print_)


def test_fingerprint_sees_a_frozen_replica_thawed():
    model = two_layers()
    model[0].bias.requires_grad_(False)
    print_ = fingerprint(model)
    assert holds(print_)
    model[0].bias.requires_grad_(True)
    assert not print_.same_structure()


def storages(layout: BucketLayout) -> int:
    seen = {}
    for bucket in layout.buckets:
        if bucket.flat is not None:
            seen[bucket.flat.untyped_storage().data_ptr()] = bucket.flat.untyped_storage().nbytes()
    return sum(seen.values())


def grads_and_reductions():
    grads = [
        torch.ones(10),
        torch.ones(20),
        torch.ones(5, dtype=torch.bfloat16),
    ]  # wire: 40, 80, 20 bytes
    return grads, ["mean"] * 3, [0, 1, 2], [True] * 3


def test_persistent_buffers_stay_within_the_budget_and_views_only_for_fp32():
    grads, reductions, indices, plain = grads_and_reductions()
    tight = BucketLayout(grads, reductions, indices, plain, "cpu", 100)
    assert [b.indices for b in tight.buckets] == [[0], [1], [2]]
    assert [b.as_view for b in tight.buckets] == [False, False, False] and storages(tight) == 80
    roomy = BucketLayout(grads, reductions, indices, plain, "cpu", 1000)
    assert [b.indices for b in roomy.buckets] == [[0, 1], [2]]
    assert [b.as_view for b in roomy.buckets] == [True, False] and storages(roomy) == 120 + 20
    transient = BucketLayout(grads, reductions, indices, plain, "cpu", 1000, persistent=False)
    assert storages(transient) == 0


def test_pack_and_unpack_round_trip_through_the_wire_dtype():
    tensors = [torch.arange(6.0).reshape(2, 3), torch.tensor([1.5, 2.5], dtype=torch.bfloat16)]
    flat = pack(tensors, wire_dtype(torch.bfloat16), "cpu")
    assert flat.dtype == torch.float32 and flat.tolist() == [0, 1, 2, 3, 4, 5, 1.5, 2.5]
    flat.mul_(2)
    unpack(flat, tensors)
    assert tensors[0].tolist() == [[0, 2, 4], [6, 8, 10]] and tensors[1].tolist() == [3.0, 5.0]
    assert [v.shape for v in flat_views(flat, [torch.Size([2, 3]), torch.Size([2])])] == [
        (2, 3),
        (2,),
    ]
    assert [
        len(c) for c in bounded_chunks([torch.zeros(3), torch.zeros(3, dtype=torch.bfloat16)], 16)
    ] == [1, 1]
