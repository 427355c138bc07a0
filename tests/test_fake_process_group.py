"""Successive fake process groups in one process: a pipeline's ranks, a layout search's layouts."""

import torch

from autotune.distributed.sharding.ranks import fake_process_group


def _sharded_op_in_a_fresh_group():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    with fake_process_group(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        a = distribute_tensor(torch.randn(8, 8), mesh["tp"], [Shard(0)])
        b = distribute_tensor(torch.randn(8, 8), mesh["tp"], [Replicate()])
        out = torch.relu(a @ b) + a
        # A collective on the output's mesh: a mesh of a destroyed group would fail here.
        out.redistribute(out.device_mesh, [Replicate()])
        return out.device_mesh is a.device_mesh


def test_a_later_group_gets_no_cached_spec_on_an_earlier_groups_mesh():
    """DTensor caches output specs by input specs, and meshes of the same shape compare equal:
    without retiring the first group's meshes, the second group's op came back on the first
    group's (destroyed) mesh."""
    assert _sharded_op_in_a_fresh_group()
    assert _sharded_op_in_a_fresh_group()
    assert _sharded_op_in_a_fresh_group()


def test_fake_groups_leave_the_processs_excepthook_as_they_found_it(monkeypatch):
    """torch's init_process_group wraps sys.excepthook ("[rank{r}]: " on every traceback line) and
    never unwraps it: a plan opens a fake group per trial, and a user's traceback after plan()
    printed "[rank0]: [rank0]: ... [rank4]: " before each line (the pipeline's fake rank 4 in a
    process that had no ranks)."""
    import io
    import sys

    # Python's own hook: a real group an earlier test initialised in this process wrapped it.
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    before = sys.excepthook
    for rank in (0, 3):
        with fake_process_group(4, rank=rank):
            pass
    assert sys.excepthook is before
    try:
        raise ValueError("a user's own error")
    except ValueError:
        kind, value, tb = sys.exc_info()
    printed, sys.stderr = sys.stderr, io.StringIO()
    try:
        sys.excepthook(kind, value, tb)
        text = sys.stderr.getvalue()
    finally:
        sys.stderr = printed
    assert "[rank" not in text and "a user's own error" in text
