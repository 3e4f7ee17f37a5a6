"""MiCRO's and ExDyna's options, and the most coordinates a rank sends per group and step."""
from __future__ import annotations

from dataclasses import dataclass

from horovod_sparse.common.capacity import CappedOptions, capacity_count
from horovod_sparse.common.validation import check_choice, check_int
from horovod_sparse.methods.micro.controllers import CONTROLLERS
from horovod_sparse.methods.micro.partitions import BALANCERS


@dataclass(frozen=True)
class MicroOptions(CappedOptions):
    """Options of MiCRO (and, with more fields, ExDyna).

    Attributes:
        capacity, capacity_floor: as :class:`~horovod_sparse.common.capacity.CappedOptions`,
            with a rank's share of the target, ``ceil(k / n)``, in place of ``k``
            (:func:`share_capacity`): by default a rank sends at most twice its share (at least
            1024 coordinates) per group and step; what its partition selects beyond that stays
            in its residual (``overflow``). On an accelerator every rank sends exactly that
            many indices, padded, and the values' allreduce runs over ``n`` times that.
        controller: how the threshold is chosen each step: ``"histogram"`` (default: follows
            the current step's gradient through one allreduce of about 1 KB), ``"paper"``
            (the published multiplicative rule) or ``"paper_intent"`` (the same with the
            presumed intent of its band rule). See :mod:`horovod_sparse.methods.micro.controllers`.
    """

    controller: str = "histogram"

    def _validate(self) -> None:
        super()._validate()
        check_choice("controller", self.controller, CONTROLLERS)


@dataclass(frozen=True)
class ExDynaOptions(MicroOptions):
    """Options of ExDyna: MiCRO's plus the block partitions.

    Attributes:
        balancer: how partition boundaries move: ``"prefix"`` (default: each boundary by the
            cumulative excess of the partitions left of it) or ``"paper"`` (the published
            pairwise rule). See :mod:`horovod_sparse.methods.micro.partitions`.
        num_blocks: blocks the buffer is cut into (the paper uses 1024).
    """

    balancer: str = "prefix"
    num_blocks: int = 1024

    def _validate(self) -> None:
        super()._validate()
        check_choice("balancer", self.balancer, BALANCERS)
        object.__setattr__(self, "num_blocks", check_int("num_blocks", self.num_blocks, minimum=1))


def share_capacity(options: MicroOptions, k: int, parts: int, numel: int) -> int:
    """The most coordinates a rank sends per group and step: :func:`capacity_count` of its share
    ``ceil(k / parts)`` of the target ``k`` (``numel``: the group's size)."""
    return capacity_count(options, -(-k // parts), numel)
