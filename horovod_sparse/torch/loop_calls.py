"""What a training loop calls on a Horovod optimizer around the exchange, as
``hvd.DistributedOptimizer`` defines it: ``step()`` synchronizes first (unless inside
``skip_synchronize()``, after a ``synchronize()`` of the loop's own: gradient clipping),
``zero_grad()`` refuses to run while a step's exchange is in flight, and
``set_backward_passes_per_step()`` changes the local accumulation between steps."""
from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Any, Iterator

from horovod_sparse.common.arguments import check_backward_passes


class LoopCalls:
    """The training loop's calls of :class:`~horovod_sparse.torch.exchanging.ExchangingOptimizer`
    (a base of it, its methods copied with it into the user's optimizer class): they read its
    ``synchronize()``, the step abandoned for a non-finite gradient (``_abandoned``), the flights
    in progress (``_engine``), the gradients' readiness (``_readiness``) and the wrapped
    optimizer's step (``_base_step``)."""

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Within this context ``step()`` does not synchronize (call ``synchronize()`` first)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        """Synchronize (unless skipped), then the wrapped optimizer's step, skipped after an
        abandoned step whose update the policy skips."""
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context "
                              "after optimizer.synchronize(). This can cause training slowdown.", stacklevel=2)
            self.synchronize()
        self._synchronized = False
        # A GradScaler stepping a fused optimizer sets its found_inf attribute on an overflow.
        if self._abandoned.skips_update(kernel_skips=getattr(self, "found_inf", None) is not None):
            return None
        return self._base_step(closure)  # type: ignore[attr-defined]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's ``zero_grad``, refused while a step's exchange is in flight."""
        if self._engine.flights:  # launched this step, not finished
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(). This is prohibited as "
                                 "it can cause a race condition.")
        super(self.__class__, self).zero_grad(set_to_none)  # type: ignore[misc]

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Accumulate ``passes`` backward passes locally before each exchange, from now on."""
        self.backward_passes_per_step = passes = check_backward_passes(passes)
        self._readiness.restart(passes)

