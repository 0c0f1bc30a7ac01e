"""Gradient finalisation for every step of a run, reading the device at its first step only.

``finalize_dtensor_gradients`` asks every rank, before its flat all-reduce, which gradients it
holds (a read of the device): the buffers must match across ranks. A run's steps make the same
gradients in the same placements, so :class:`StepFinalizer` learns them at its first step (that
check, once) and then sums the same buffers on every rank without asking: a gradient missing on
a rank is summed as zeros (its share of a sum) and each gradient's presence is summed in the
buffer's tail. What the check found at once is then a device count, :meth:`problems`: gradients
present on some ranks of their sum and not on others, and gradients whose placements are not the
learned ones (made zeros of their parameter's placements, so every rank goes on alike). The
step's readout reads it with its other values before the update, and :meth:`verify` raises on
every rank if it is not zero.
"""

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from components.distributed.grads import (
    check_partial_candidates_present,
    named_trainable,
    replicated,
    sort_gradients,
    sum_group,
    sum_partial_groups,
)
from components.distributed.replicas.flat_buffers import wire_dtype


@dataclass(frozen=True, kw_only=True)
class _Member:
    """A gradient learned at the first step: its parameter, placements and local shape."""

    name: str
    parameter: nn.Parameter
    placements: tuple
    shape: torch.Size


def _order(named: list[tuple[str, nn.Parameter]]) -> list[tuple]:
    """What a learned finalisation holds for: the same parameters (a rebuilt or re-made model is
    learned again) in the same dtypes (a cast one too)."""
    return [(id(parameter), parameter.dtype) for _, parameter in named]


def _zeros(parameter: nn.Parameter, dtype: torch.dtype) -> DTensor:
    """A zero gradient in the parameter's placements (what a gradient not learned becomes)."""
    local = torch.zeros_like(parameter._local_tensor, dtype=dtype)
    mesh, placements = parameter.device_mesh, parameter.placements
    shape, stride = parameter.shape, parameter.stride()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


class StepFinalizer:
    """Made once per run; called once per optimizer step like ``finalize_dtensor_gradients``."""

    def __init__(self) -> None:
        self._learned: dict[tuple, list[_Member]] | None = None  # None: learn at the next call
        self._order: list[tuple] = []  # the trainable parameters learned from: identity, dtype
        self._members: set[int] = set()
        self._present: dict[tuple, torch.Tensor] = {}  # per group: every gradient present
        self._counts: list[tuple[torch.Tensor, int, list[str]]] = []  # this step's, summed
        self._departed: list[str] = []  # this step's gradients not as learned

    @torch.no_grad()
    def __call__(self, model_parts: list[nn.Module]) -> int:
        """Give every DTensor gradient its parameter's placements; return how many changed."""
        named = named_trainable(model_parts)
        self._counts, self._departed = [], []
        if self._learned is None or _order(named) != self._order:
            return self._learn(model_parts, named)
        return self._sum_as_learned(named)

    def _learn(self, model_parts: list[nn.Module], named: list) -> int:
        """``finalize_dtensor_gradients`` itself (its presence check reads the device), keeping
        its groups; a step that redistributes a gradient is learned again at the next."""
        if not any(isinstance(parameter, DTensor) for _, parameter in named):
            self._learned, self._members, self._order = {}, set(), _order(named)
            return 0
        check_partial_candidates_present(model_parts)
        groups, redistributed = sort_gradients(named)
        learned = {key: list(map(self._member, members)) for key, members in groups.items()}
        changed = redistributed + sum_partial_groups(groups)
        self._learned = None if redistributed else learned
        self._members = {id(m.parameter) for members in learned.values() for m in members}
        self._present = {
            key: torch.ones(len(members), dtype=wire_dtype(key[2]), device=key[3])
            for key, members in learned.items()
        }
        self._order = _order(named)  # last: a check that raised leaves nothing learned
        return changed

    @staticmethod
    def _member(entry: tuple[str, nn.Parameter]) -> _Member:
        name, parameter = entry
        grad = parameter.grad
        placements, shape = grad.placements, grad._local_tensor.shape
        return _Member(name=name, parameter=parameter, placements=placements, shape=shape)

    def _sum_as_learned(self, named: list[tuple[str, nn.Parameter]]) -> int:
        for name, parameter in named:
            grad = parameter.grad
            if (
                isinstance(grad, DTensor)
                and grad.placements != parameter.placements
                and id(parameter) not in self._members
            ):
                self._departed.append(name)
                parameter.grad = _zeros(parameter, grad.dtype)
        changed = 0
        for key, members in self._learned.items():
            changed += self._sum_group(key, members)
        return changed

    def _sum_group(self, key: tuple, members: list[_Member]) -> int:
        mesh, dims, dtype, device = key
        locals_, present, taken = [], self._present[key].clone(), []
        for index, member in enumerate(members):
            grad = member.parameter.grad
            if grad is None:
                present[index] = 0  # a fill with a host number: no copy, no wait
            elif (
                isinstance(grad, DTensor)
                and grad.placements == member.placements
                and grad._local_tensor.dtype == dtype
                and grad._local_tensor.shape == member.shape
            ):
                locals_.append(grad._local_tensor)
                taken.append(member)
                continue
            else:
                self._departed.append(member.name)
                member.parameter.grad = _zeros(member.parameter, grad.dtype)
            locals_.append(torch.zeros(member.shape, dtype=dtype, device=device))
        sum_group(key, [*locals_, present])
        size = math.prod(mesh.size(dim) for dim in dims)
        self._counts.append((present, size, [member.name for member in members]))
        for member in taken:
            member.parameter.grad = replicated(member.parameter.grad, member.parameter)
        return len(taken)

    def problems(self) -> torch.Tensor | int:
        """This step's gradients present on some ranks of their sum and not on all, or not as
        learned: a device count (unread) or 0."""
        total = len(self._departed)
        for present, size, _ in self._counts:
            total = total + ((present > 0) & (present < size)).sum()
        return total

    def verify(self, problems: float) -> None:
        """Raise, naming what this rank saw, if ``problems`` (the largest over every rank) is not
        zero; every rank is handed the same number, so every rank raises."""
        if not problems:
            return
        differing = [
            name
            for present, size, names in self._counts
            for name, count in zip(names, present.tolist(), strict=True)  # a failed step's read
            if 0 < count < size
        ]
        found = []
        if differing:
            found.append(f"Gradient presence differs across ranks: {', '.join(differing)}")
        if self._departed:
            found.append(
                "gradient placements, dtypes or shapes differ from the first step's, which "
                "finalisation learns them from (a parameter first used after it is not "
                f"supported): {', '.join(self._departed)}"
            )
        raise RuntimeError("; ".join(found) or "Gradients differ across ranks (on another rank)")
