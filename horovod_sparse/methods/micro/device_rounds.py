"""The histogram controller's rounds on an accelerator: the same threshold, decided on the device.

On the host (:func:`~horovod_sparse.methods.micro.controllers.histogram_threshold`) each round is
decided from the summed histogram of the last, read on the host: a wide round only when the first
stopped short of ``k``, a fine round only when its reading was coarse. On an accelerator that read
would stall the queue, so the rounds are fixed and the choice among their readings is made on
the device:

1. ``histogram``: this rank's histograms in the controller's window of its coordinates at or
   above both its bars (the usual budget's and the wide one's), summed in one allreduce, and
   both read (:meth:`~horovod_sparse.methods.backend.Backend.read_histograms`: the readings
   packed, a row each, :data:`READING_FIELDS`);
2. ``histogram.fine``: both histograms again in the fine window around the threshold the host
   would have settled on after its first one or two rounds (the wide reading if the first stopped
   short, else the first), one allreduce, both read.

Of those four readings (the rows :data:`FIRST`, :data:`WIDE`, :data:`FINE`, :data:`FINE_WIDE`)
the device picks the one the host's rounds end with (:meth:`~horovod_sparse.methods.backend.
Backend.settle`: the :class:`RoundFlags` read as a binary number index :data:`SETTLED_ROWS`,
:func:`settled_row` for every value), so the threshold and the controller's flags are the host's
bitwise; what the host rounds would have been is kept as the :class:`RoundFlags` and named when
the step's figures are read (:func:`rounds_taken`). The cost: a second allreduce of about 2 KB
every step, where the host takes one in most steps.
"""
from __future__ import annotations

import itertools
from typing import Any, Generator, List, NamedTuple, Tuple

from horovod_sparse.methods.backend import Backend, Tensor
from horovod_sparse.methods.micro.controllers import (HistogramController, HistogramRound, ThresholdState,
                                                      candidate_budget)


class DeviceReading(NamedTuple):
    """:class:`~horovod_sparse.methods.micro.controllers.Reading` with 0-dim tensors left on a
    device: the float32 threshold and the flags (0 or 1)."""

    threshold: Tensor
    outside: Tensor
    short: Tensor
    coarse: Tensor


#: A packed reading's columns (:meth:`~horovod_sparse.methods.backend.Backend.read_histograms`):
#: the threshold's float32 bit pattern, then the flags.
READING_FIELDS = DeviceReading._fields
#: The rows of the four readings the rounds take: the first round's at the usual bar and at the
#: wide one, then the fine round's.
FIRST, WIDE, FINE, FINE_WIDE = range(4)


class RoundFlags(NamedTuple):
    """What decides which rounds the host would have taken (0-dim tensors, or once read, ints):
    the first reading stopped short of ``k``, was coarse; the wide one was coarse; the fine one
    (of the usual candidates) stopped short."""

    short: Any
    coarse: Any
    wide_coarse: Any
    fine_short: Any


#: Where each of the :class:`RoundFlags` is among the four readings: (row, field).
ROUND_FLAGS = ((FIRST, "short"), (FIRST, "coarse"), (WIDE, "coarse"), (FINE, "short"))


def rounds_taken(flags: RoundFlags) -> List[str]:
    """The rounds the host's :func:`~horovod_sparse.methods.micro.controllers.histogram_threshold`
    takes, by name, given the readings' flags (read)."""
    if flags.short:
        return ["histogram", "histogram.wide"] + (["histogram.fine"] if flags.wide_coarse else [])
    if flags.coarse:
        return ["histogram", "histogram.fine"] + (["histogram.wide"] if flags.fine_short else [])
    return ["histogram"]


def settled_row(flags: RoundFlags) -> int:
    """The reading the host's rounds end with (its row), given the :class:`RoundFlags`: the last
    of :func:`rounds_taken`, read in the window and at the bar that round used."""
    if flags.short:
        return FINE_WIDE if flags.wide_coarse else WIDE
    if flags.coarse:
        return FINE_WIDE if flags.fine_short else FINE
    return FIRST


#: :func:`settled_row` for every value of the :class:`RoundFlags`, read as a binary number (the
#: first flag the highest bit).
SETTLED_ROWS = tuple(settled_row(RoundFlags(*bits)) for bits in itertools.product((0, 1), repeat=4))


def _places(flags: Tuple[Tuple[int, str], ...]) -> Tuple[Tuple[int, int], ...]:
    """``(row, field name)`` pairs as (row, column) of the packed readings."""
    return tuple((row, READING_FIELDS.index(name)) for row, name in flags)


def device_histogram_threshold(B: Backend, controller: HistogramController, state: ThresholdState, k: int,
                               parts: int, partition: int, rank: int, scanned: Any
                               ) -> Generator[HistogramRound, Tensor, Tuple[DeviceReading, RoundFlags]]:
    """This step's threshold from the histogram controller on an accelerator, as a conversation
    with the exchange (like the host's ``histogram_threshold``: yields each round's local
    histograms, is sent their sum, still on the device). ``scanned``: the scan of the partition
    this rank owns (``partition``). Returns ``(reading, flags)``: the :class:`DeviceReading` the
    host's rounds settle on and the :class:`RoundFlags` naming them; ``state`` is not changed
    (the exchange updates it when the step's figures are read)."""
    window = controller.window(state)
    bars = B.candidate_bars(scanned, (candidate_budget(k, parts, state.last_counts, partition),
                                      candidate_budget(k, parts, state.last_counts, partition, wide=True)))
    edges = B.window_edges(window, scanned)
    summed = yield HistogramRound(B.histograms_above(edges, scanned, bars, rank, parts), "histogram")
    first = B.read_histograms(edges, summed, k, 2)
    centre, _ = B.settle(first, _places(((FIRST, "short"),)), (FIRST, WIDE))
    fine = B.fine_edges(centre)
    summed = yield HistogramRound(B.histograms_above(fine, scanned, bars, rank, parts), "histogram.fine")
    readings = B.concat([first, B.read_histograms(fine, summed, k, 2)])
    settled, flags = B.settle(readings, _places(ROUND_FLAGS), SETTLED_ROWS)
    return B.unpack_reading(settled), RoundFlags(*flags)
