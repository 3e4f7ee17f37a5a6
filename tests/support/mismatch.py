"""Configuration mismatches across ranks, one per field of the configuration fingerprint, for the
reliability jobs of both front ends: rank 1 builds its wrapper with ``rank1`` over the case's
``rank0`` settings, and every rank must raise the documented ``ValueError`` naming rank 1 and
the setting (``expect``), instead of hanging in a collective.

The options part is generated: every option of every registered method, so an option added
later is covered (or this module fails to import, asking for an alternative value)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List

import horovod_sparse.methods  # noqa: F401  (fills the registry)
from horovod_sparse.common import registry
from horovod_sparse.common.mergecomp import MergeCompOptions

#: The options every case starts from (on both ranks), besides the method's defaults.
BASE_OPTIONS = {"density": 0.05, "min_numel": 0}
#: Rank 1's value of each option: valid, and different from the default and from BASE_OPTIONS.
ALTERNATIVE = {"density": 0.02, "min_numel": 7, "warmup_steps": 1, "fp16_values": True,
               "density_schedule": "exp_warmup:5", "residual": "paper", "recall_every": 3, "group_size": 100,
               "adaptive": False, "slack": 0.1, "max_density": 0.3, "measure_steps": 2, "controller": "paper",
               "balancer": "paper", "num_blocks": 64, "sample_ratio": 0.05, "max_adaptations": 3, "momentum": 0.9,
               "capacity": 3.0, "capacity_floor": 64, "chunk_size": 64, "bits": 4, "quantization_range": 3.0,
               "error_decay": 0.95, "blocks": True}
#: (method, option) pairs whose alternative the method refuses outright: nothing to mismatch.
REFUSED = {("gtopk", "fp16_values"), ("sparseloco", "density_schedule")}


def option_cases() -> List[Dict[str, Any]]:
    """One case per option of every registered method, plus one for the method itself."""
    cases = [{"name": "method", "rank0": {"method": "topk"}, "rank1": {"method": "gtopk"},
              "expect": "compression.method='gtopk' (rank 0: 'topk')"}]
    for method in registry.method_names():
        rank0 = registry.make_options(method, **BASE_OPTIONS)
        for field in dataclasses.fields(rank0):
            if field.name not in ALTERNATIVE:
                raise KeyError(f"tests/support/mismatch.py: add a valid alternative value of option {field.name!r} "
                               f"({method}) to ALTERNATIVE, so its mismatch across ranks is tested")
            options = {**BASE_OPTIONS, field.name: ALTERNATIVE[field.name]}
            try:
                rank1 = registry.make_options(method, **options)
            except (TypeError, ValueError):
                if (method, field.name) in REFUSED:
                    continue
                raise
            before, after = getattr(rank0, field.name), getattr(rank1, field.name)
            assert before != after, f"{method}.{field.name}: the alternative is rank 0's value"
            cases.append({"name": f"{method}.{field.name}", "rank0": {"method": method},
                          "rank1": {"method": method, "options": options},
                          "expect": f"compression.{field.name}={after!r} (rank 0: {before!r})"})
    return cases


def wrapper_cases(param: Callable[[str, int], str], dtype: Callable[[str], str], average: str,
                  total: str) -> List[Dict[str, Any]]:
    """:func:`option_cases` and the cases both front ends share (op, nonfinite, grouping, MergeComp
    options, group sizes, dtypes) on the reliability workers' shapes (1200, 30 and 180 elements), in each front
    end's spelling: ``param(case, i)`` names parameter i, ``dtype(name)`` a dtype, ``average`` and
    ``total`` the ops ``Average`` and ``Sum``."""
    float32, float64 = dtype("float32"), dtype("float64")
    return option_cases() + [
        {"name": "op", "rank0": {}, "rank1": {"wrapper": {"op": "Sum"}},
         "expect": f"op={total!r} (rank 0: {average!r})"},
        {"name": "nonfinite", "rank0": {}, "rank1": {"wrapper": {"nonfinite": "skip"}},
         "expect": "nonfinite='skip' (rank 0: 'raise')"},
        {"name": "sparse_as_dense", "rank0": {}, "rank1": {"wrapper": {"sparse_as_dense": True}},
         "expect": "sparse_as_dense=True (rank 0: False)"},
        {"name": "grouping", "rank0": {}, "rank1": {"wrapper": {"groups": "model"}},
         "expect": f"groups.group0.{param('grouping', 0)}='1410 x {float32}' (rank 0: '<missing>')"},
        {"name": "mergecomp", "rank0": {"wrapper": {"groups": {"mergecomp": {}}}},
         "rank1": {"wrapper": {"groups": {"mergecomp": {"timed_steps": 3}}}},
         "expect": f"mergecomp={repr(MergeCompOptions(timed_steps=3))!r} (rank 0: {repr(MergeCompOptions())!r})"},
        {"name": "group_size", "rank0": {}, "rank1": {"shapes": [[40, 30], [31], [20, 9]]},
         "expect": f"groups.{param('group_size', 1)}='31 x {float32}' (rank 0: '30 x {float32}')"},
        {"name": "dtype", "rank0": {}, "rank1": {"dtype": "float64"},
         "expect": f"groups.{param('dtype', 1)}='30 x {float64}' (rank 0: '30 x {float32}')"},
    ]


def wrapper_arguments(settings: Dict[str, Any], hvd: Any) -> Dict[str, Any]:
    """A case's ``wrapper`` arguments as the front end takes them: ``op`` given by name (an
    attribute of the Horovod module ``hvd``) and ``groups`` given as ``{"mergecomp": {options}}``
    resolved."""
    wrapper = dict(settings.get("wrapper", {}))
    if "op" in wrapper:
        wrapper["op"] = getattr(hvd, wrapper["op"])
    if isinstance(wrapper.get("groups"), dict):
        wrapper["groups"] = MergeCompOptions(**wrapper["groups"]["mergecomp"])
    return wrapper


def assert_every_rank_refused(recs: List[Dict[str, Any]], case: Dict[str, Any]) -> None:
    """Every rank's record of ``case`` holds the ValueError naming rank 1 and the setting."""
    for rank, rec in enumerate(recs):
        message = rec[case["name"]]
        assert message is not None, f"rank {rank} went on without an error"
        assert "rank 1 differs from rank 0" in message and case["expect"] in message, message
