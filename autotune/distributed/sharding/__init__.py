"""Sharding: how a plan spreads the model over ranks (DDP replicas or FSDP2 shards).

- ``settings``: the ``Sharding`` choice, the shard group and the process layout they imply.
- ``wrap``: apply a plan's sharding to a model with FSDP2 (``fully_shard``).
"""

from .settings import Sharding

__all__ = ["Sharding"]
