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
