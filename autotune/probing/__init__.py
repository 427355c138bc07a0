"""Probing: find the largest micro-batch whose steady-state training step fits.

- ``api``: ``probe()``.
- ``trial``: one training step on a memory backend (``TrialSession``).
- ``estimate``: the same step on fake tensors (``estimate_peak``).
- ``seed``: start the search from the estimate.
- ``blocks``: how many repeated blocks to checkpoint (the per-block saving, the real proof).
- ``search``: the search over micro-batches and the fitted memory model.
- ``result``: ``ProbeResult``, ``Trial``, ``MemoryModel``.
"""
