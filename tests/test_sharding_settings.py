"""The sharding setting: parsing, shard groups, meshes, and FSDP2 wrapping of the repeated blocks."""

import pytest
import torch

from autotune.errors import ConfigError
from autotune.distributed.sharding import Sharding
from autotune.distributed.sharding.settings import mesh_shape, resolve_shard_group
from autotune.errors import cli_words


def test_parse_and_properties():
    assert Sharding.parse("FSDP-offload") is Sharding.FSDP_OFFLOAD
    assert f"{Sharding.FSDP}" == "fsdp" and Sharding.FSDP == "fsdp"
    assert Sharding.FSDP.sharded and not Sharding.DDP.sharded and Sharding.FSDP_OFFLOAD.offload
    with pytest.raises(ConfigError, match="sharding='zero3' is not a sharding; use one of ddp, fsdp, fsdp-offload"):
        Sharding.parse("zero3")
    with cli_words(), pytest.raises(ConfigError, match="--sharding 'zero3' is not a sharding"):
        Sharding.parse("zero3")


def test_shard_group_must_divide_the_world_size():
    assert resolve_shard_group(None, 8) == 8
    assert resolve_shard_group(2, 8) == 2
    with pytest.raises(ConfigError, match="shard_group=3 does not divide world_size=8; use one of 1, 2, 4, 8"):
        resolve_shard_group(3, 8)
    with cli_words(), pytest.raises(ConfigError, match="--shard-group 3 does not divide --world-size 8"):
        resolve_shard_group(3, 8)
    with pytest.raises(ConfigError, match="positive int"):
        resolve_shard_group(0, 8)
    assert mesh_shape(8, 8) == (8,) and mesh_shape(8, 2) == (4, 2)


def test_shard_model_shards_every_repeated_block_and_the_root(examples_dir):
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autotune.distributed.sharding.wrap import build_mesh, shard_model
    from autotune.workload import load_workload
    from autotune.workload.activation_checkpointing import repeated_blocks

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        model = load_workload(examples_dir / "tiny_lm.py").new_model()
        full = sum(p.numel() for p in model.parameters())
        blocks = repeated_blocks(model)
        shard_model(model, mesh=build_mesh("cpu", 4, 4), sharding="fsdp", precision="bf16")
        assert isinstance(model, FSDPModule) and all(isinstance(b, FSDPModule) for b in blocks)
        local = sum(p.to_local().numel() for p in model.parameters())
        assert full / 4 <= local < full / 4 + 4 * len(list(model.parameters()))
        assert all(p.dtype == torch.float32 for p in model.parameters())  # bf16 is compute only
    finally:
        dist.destroy_process_group()
