"""The two-tier exchange's layout rules (horovod_sparse.common.tiers), in-process: the slices,
the nodes and cross sets, when a job runs flat, and the errors that name the fix."""
import warnings
from types import SimpleNamespace

import pytest

from horovod_sparse.common.horovod_tiers import horovod_tiers
from horovod_sparse.common.tiers import NodeLayout, make_tiers, slice_bounds, wants_hierarchical


@pytest.mark.parametrize("numel", [1, 2, 7, 8, 100, 101])
@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_slices_split_as_horovods_reducescatter(numel, parts):
    """Horovod's reduce-scatter: numel // parts each, the first numel % parts one more (the 2 x 2
    job of test_two_tier checks the real collective agrees, bitwise, on odd sizes)."""
    bounds = [slice_bounds(numel, parts, i) for i in range(parts)]
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert [hi - lo for lo, hi in bounds] == sorted((hi - lo for lo, hi in bounds), reverse=True)
    assert max(hi - lo for lo, hi in bounds) - min(hi - lo for lo, hi in bounds) <= 1


def test_layout_from_places_with_interleaved_ranks():
    # ranks 0 and 2 on node 0, 1 and 3 on node 1 (a launcher that deals ranks round-robin)
    layout = NodeLayout.from_places([(0, 0), (1, 0), (0, 1), (1, 1)])
    assert layout.nodes == ((0, 2), (1, 3))
    assert layout.cross_sets() == [[0, 1], [2, 3]]
    assert (layout.local_size, layout.cross_size, layout.flat) == (2, 2, False)
    # the member of slice 1's cross set standing for root 3 (node 1) is rank 3, position 1 in [2, 3]
    assert layout.cross_root(3, 1) == 1 and layout.cross_root(0, 1) == 0 and layout.cross_root(2, 0) == 0


def test_each_ranks_slice_and_sets_with_interleaved_ranks():
    layout = NodeLayout.from_places([(0, 0), (1, 0), (0, 1), (1, 1)])
    made = [make_tiers(True, rank, lambda: layout, tuple) for rank in range(4)]
    assert [(t.node_set, t.cross_set, t.node_rank, t.cross_rank) for t in made] == [
        ((0, 2), (0, 1), 0, 0), ((1, 3), (0, 1), 0, 1), ((0, 2), (2, 3), 1, 0), ((1, 3), (2, 3), 1, 1)]
    assert made[3].cross_root(0) == 0 and made[3].cross_root(3) == 1 and made[0].bounds(7) == (0, 4)


@pytest.mark.parametrize("places", [[(0, 0), (0, 1)], [(0, 0), (1, 0), (2, 0)]], ids=["one-node", "one-per-node"])
def test_one_node_or_one_worker_per_node_runs_flat(places):
    assert NodeLayout.from_places(places).flat
    hvd = SimpleNamespace(cross_rank=lambda: 0, local_rank=lambda: 0, rank=lambda: 0)
    assert horovod_tiers(True, hvd, SimpleNamespace(process_set_id=0), lambda place: places) is None


def test_nodes_of_different_sizes_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"same number of workers on every node.*\{0: 2, 1: 1\}.*hierarchical=False"):
        NodeLayout.from_places([(0, 0), (0, 1), (1, 0)])


def test_another_process_set_is_refused_when_asked_and_warns_when_only_following_horovod(monkeypatch):
    hvd = SimpleNamespace(cross_rank=lambda: 0, local_rank=lambda: 0, rank=lambda: 0)
    subset = SimpleNamespace(process_set_id=3)
    with pytest.raises(ValueError, match="needs the global process set"):
        horovod_tiers(True, hvd, subset, lambda place: [])
    monkeypatch.setenv("HOROVOD_HIERARCHICAL_ALLREDUCE", "1")
    with pytest.warns(RuntimeWarning, match="HOROVOD_HIERARCHICAL_ALLREDUCE=1 asks for the two-tier"):
        assert horovod_tiers(None, hvd, subset, lambda place: []) is None


def test_hierarchical_none_follows_horovods_switch(monkeypatch):
    monkeypatch.delenv("HOROVOD_HIERARCHICAL_ALLREDUCE", raising=False)
    assert wants_hierarchical(None) is False
    monkeypatch.setenv("HOROVOD_HIERARCHICAL_ALLREDUCE", "1")
    assert wants_hierarchical(None) is True and wants_hierarchical(False) is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(TypeError, match="hierarchical must be True, False or None"):
            wants_hierarchical("yes")


def test_missing_process_sets_are_refused_with_the_fix(monkeypatch):
    registered = SimpleNamespace(_get_process_set_ids_and_ranks=lambda: {0: [0, 1, 2, 3]})
    monkeypatch.delenv("HOROVOD_DYNAMIC_PROCESS_SETS", raising=False)
    hvd = SimpleNamespace(cross_rank=lambda: 0, local_rank=lambda: 0, rank=lambda: 0,
                          mpi_ops=SimpleNamespace(_basics=registered))
    two_by_two = [(0, 0), (0, 1), (1, 0), (1, 1)]
    with pytest.raises(ValueError, match=r'hvd.init\(process_sets="dynamic"\).*missing: ranks \[0, 1\]'):
        horovod_tiers(True, hvd, SimpleNamespace(process_set_id=0), lambda place: two_by_two)
