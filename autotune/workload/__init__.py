"""The workload: the model file's contract and what autotune does to a user's model.

- ``contract``: ``Workload``, ``load_workload`` and the model file's functions.
- ``activation_checkpointing``: wrap the repeated blocks of a model (all, or K spread evenly).
- ``checkpoint_count``: ``Checkpointing`` (off, every block, K of N), the one checkpointing value,
  and ``CheckpointingRequest``, the user's ``--checkpointing`` (auto|off|on|K|fraction).
"""

from .contract import Workload, load_workload, move_batch

__all__ = ["Workload", "load_workload", "move_batch"]
