"""Planning: turn what the probe measured into an exact split of the target batch.

- ``types``: the ``Plan`` and its parts, plain dataclasses.
- ``policy``: the pure planner (split, settings, warnings); ``build_plan`` is where a Plan is made.
- ``lr``: the learning-rate rules.
- ``api``: ``plan()``, which probes each setting and hands the results to the policy.
- ``planfile``: the JSON plan file and its schema (``schemas/``).
- ``export``: configs for other runners.
- ``verify``: run a saved plan's micro-batch on this device.

This package imports nothing at import time, so its modules can depend on one another one way.
"""
