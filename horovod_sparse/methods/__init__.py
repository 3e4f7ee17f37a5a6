"""The sparsification methods, one module each, written once for PyTorch and TensorFlow.

A method is a :class:`~horovod_sparse.methods.base.Sparsifier` subclass in its own module,
registered with ``@implements(name, options, summary)``; the import below is the one line that
lists the modules. It never imports a framework: each instance holds its framework's backend as
``self.B`` and launches collectives through the ``comm`` its ``exchange`` receives.

The backend primitives (contracts in :mod:`horovod_sparse.methods.backend`):

* sizes and host values: ``numel``, ``size``, ``to_numpy``, ``from_numpy``, ``saved`` and
  ``from_saved`` (a tensor's checkpoint form), ``reshape_one``, ``chunk_counts``, ``host_call``
  (a host decision, deferred to step time when traced);
* selection, ascending int64 indices with ties to the lower index: ``top_k``, ``select``,
  ``scan`` (block maxima, optional moments), ``pick``, ``pick_with_magnitudes``, ``at_least``
  (the histogram controller's candidates, :mod:`horovod_sparse.methods.micro.candidates`);
* payloads of fixed capacity (a :class:`~horovod_sparse.methods.backend.Capped` selection,
  padded on an accelerator) and the threshold decisions that stay there: ``pick_capped``,
  ``count_reaching``, ``lowered_thresholds``, ``counts_at``, ``first_settled``, ``top_k_capped``,
  ``band``, ``as_threshold``, ``delivered``, ``unpadded``, ``copy_at``;
* the histogram controller on an accelerator (:mod:`horovod_sparse.methods.micro.device_rounds`):
  ``decides_on_device``, ``candidate_bars``, ``window_edges``, ``fine_edges``, ``histograms_above``,
  ``read_histograms``, ``settle``, ``unpack_reading`` (on the host: ``candidate_bar``, ``local_histogram``);
* gathers, scatters and casts: ``clone``, ``gather``, ``to_wire``, ``wire_index``, ``as_index``,
  ``scatter_chunks``, ``scatter_set``, ``distinct``, ``coalesce``, ``isin``, ``concat``, ``mask``,
  ``splits_to``, ``momentum_step``, ``kth_magnitude``;
* chunked selection and quantized values (:mod:`horovod_sparse.methods.sparseloco`):
  ``top_k_chunks``, ``float32``, ``moments``, ``level_codes``, ``bin_means``, ``dequantize``,
  ``pack_codes``, ``unpack_codes``;
* host collectives, for measurements (:mod:`horovod_sparse.common.measurements`) and rare
  metadata: ``allgather_array``, ``allgather_bytes``.

The communicator (``horovod_sparse.<transport>.collectives.Communicator``: ``torch`` for Horovod's
PyTorch collectives, ``tensorflow``, ``distributed`` for ``torch.distributed``) gives ``allgather``,
``allreduce`` (may write into its input), ``alltoall`` (each named ``hs.<group>.<tag>``, counted
and timed in the group's statistics), ``output(x)`` (the zeroed update buffer), ``remove_delivered``
(the one way to change the residual) and ``timer(phase)``.

Importing this package registers every method.
"""
from horovod_sparse.methods import dgc, gaussiank, gtopk, lags, micro, sparseloco, threshold, topk  # noqa: F401
