"""One steady-state training step at micro-batch n, measured on a memory backend.

``TrialSession`` sets up the model (fresh from the factory, or the user's instance with its state
saved), the optimizer with its state already allocated, precision and checkpointing; ``run(n)``
takes one full step — batch, forward, backward, unscale, clip, optimizer step, zero_grad — and
reports its peak, or that it ran out of memory. ``run(n, window=k)`` measures instead the steady
state of an accumulation window of k micro-steps (see ``window_micro_batches``): the micro-steps
after a window's first start with every gradient alive, so their peak is a single step's plus
up to the gradients. Closing the session restores the user's model and returns memory to where
it was.
"""

from __future__ import annotations

import contextlib
import time

import torch

from ..distributed.collectives import max_across_ranks
from ..distributed.environment import real_ranks
from ..distributed.tensor_parallel import clip_grad_norm_
from ..errors import ProbeError, WorkloadError
from ..units import format_bytes
from ..workload.activation_checkpointing import (checkpointable_blocks, disable_checkpointing,
                                                 enable_checkpointing)
from ..workload.checkpoint_count import Checkpointing, CheckpointingRequest
from ..memory.base import MemoryBackend
from ..memory.oom import free_memory, is_oom_error
from ..precision import Precision, autocast, grad_scaler
from ..compiled import compiled_step_module, eager_module, graphs_compiled, is_compiled, \
    mark_batch_dynamic
from ..workload.contract import Workload, move_batch
from ..accumulation import WindowTotals, summed_loss
from ..workload.optimizer_steps import counted_step
from .deadline import deadline
from .fake_optimizers import build_with_real_constants, fake_step
from .result import Trial
from .step_errors import is_step_failure, original, step_failed

CLIP_NORM = 1.0
"""Gradient clipping in a trial: the norm's buffers are part of a real step's memory."""


class SetupOutOfMemory(ProbeError):
    """Parameters, buffers and optimizer state alone ran out of memory (raised by TrialSession)."""


class TrialSession:
    compiled = False
    """Whether the trials run a compiled step (set up from the workload, see ``_setup``)."""
    graphs_compiled = 0
    """Graphs torch.compile compiled during this session's trials (recompilations included)."""
    _totals = None
    """The window's loss totals, as the training loop keeps them (set while a window runs)."""

    def __init__(self, workload: Workload, backend: MemoryBackend, *, precision: Precision,
                 checkpointing=False, sharded: bool = False, offload: bool = False,
                 reduce_every_micro_step: bool = False, parallel=None):
        """``checkpointing``: a ``Checkpointing``, or any form ``CheckpointingRequest.parse``
        takes (off/on or a bool, a block count K, a fraction of the blocks); after set-up it is
        the ``Checkpointing`` of the model's ``total_blocks``.
        ``reduce_every_micro_step`` (sharded): a window's micro-steps reduce-scatter their
        gradients (sharded gradients are held between them) instead of holding this rank's
        unsharded gradients until the last, as the plan's field of that name says."""
        self.workload = workload
        self.reduce_every_micro_step = reduce_every_micro_step
        self.sharded = sharded
        """The workload's model factory shards the model (FSDP2). The full model it builds
        before sharding does not count against the budget (no rank of a real run holds it on
        the device), and one step at micro-batch 1 runs before measuring: FSDP2 sets itself up
        lazily in the first forward and keeps what it made, so the steady state is the second."""
        self.parallel = parallel if parallel is not None and not parallel.trivial else None
        """The plan's model-parallel ``Layout`` (None: data parallel only). The workload's model
        factory applies its tensor-parallel split (``autotune.distributed.apply_layout``); the
        context-parallel and pipeline steps are the session's to run."""
        self.offload = offload
        """fsdp-offload: the shards, their gradients, the optimizer state and step live in host
        memory (``backend.offloaded``, ``backend.on_host``)."""
        self.backend = backend
        self.precision = precision
        self.checkpointing: Checkpointing | CheckpointingRequest = (
            checkpointing if isinstance(checkpointing, Checkpointing)
            else CheckpointingRequest.parse(checkpointing, allow_auto=False))
        """What was asked until set-up counts the blocks; then the ``Checkpointing`` in force."""
        self.device = backend.device
        self.checkpointed_blocks = 0
        self.total_blocks = 0
        self.ranks_agree = sharded and real_ranks() > 1
        """Sharded under torchrun: each rank's trial runs FSDP2's collectives with the others, so
        every rank must run the same trials. A rank stopping mid-step at its budget would leave
        the others waiting in a collective (their peaks differ by a few percent, with when
        gloo's worker threads let go of buffers), so the step runs to its end with the budget
        lifted (up to ``_SOFT_CEILING`` times it, where the backend can lift it), and the ranks
        agree on each trial: the largest peak, and fitting only where every rank fitted. The
        search, fed the same trials, then takes the same steps on every rank."""

    def __enter__(self) -> "TrialSession":
        self._saved = None
        if self.workload.model_is_instance:
            # Before tracking starts: the backup of the user's weights is the probe's own copy,
            # not part of a training step, and must not count against the budget (an instance
            # then gets the answer its model file gets).
            self._saved = _save_module_state(self.workload.model)
        self._tracking = self.backend.tracking()
        self._tracking.__enter__()
        out_of_memory = False
        try:
            self._setup()
        except BaseException as exc:
            self._teardown()
            if is_step_failure(exc):
                raise step_failed(self, exc, None) from original(exc)
            if not is_oom_error(exc):
                raise
            out_of_memory = True
        if out_of_memory:
            raise SetupOutOfMemory(
                f"{self.workload.source}: the model's parameters, buffers and optimizer state alone "
                f"pass the {format_bytes(self.backend.budget_bytes)} budget, before any batch"
            )
        return self

    def __exit__(self, *exc_info):
        self._teardown()

    def _setup(self):
        self.model = None
        self.optimizer = None
        self.start_bytes = self.backend.current_bytes()
        with self._outside_budget():
            model = self.workload.new_model()
            if self.sharded:
                # fully_shard replaced the full parameters, but reference cycles can keep them
                # (and their bytes in the count) alive until a collection.
                self._release_memory()
        # Compiled (--compile, or build_model's own torch.compile): the trials run the compiled
        # step; blocks and checkpointing are the eager module's, which the compiled one calls.
        self.model = compiled_step_module(model.to(self.device), self.workload.compile)
        self.compiled = is_compiled(self.model)
        self.graphs_compiled = 0
        self.model.train()
        self.total_blocks = len(checkpointable_blocks(eager_module(self.model)))
        self.set_checkpointing(self.checkpointing)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if not self.params:
            raise WorkloadError(f"{self.workload.source}: the model has no trainable parameters")
        self.gradient_bytes = sum(_local(p).numel() * p.element_size() for p in self.params)
        self.optimizer = self._new_optimizer()
        self.scaler = grad_scaler(self.precision, self.device)
        self.backend.adopt([*self.model.parameters(), *self.model.buffers()])
        if self.offload:
            self._offload_shards()
        with self._outside_budget():
            with self.backend.on_host():
                self._allocate_optimizer_state()
        if self.sharded:
            # State that does not fit before the warm-up step cannot fit after it: skip the step.
            self._check_state_fits()
            with self._outside_budget():
                self._warm_up()
            self._check_state_fits()

    def _new_optimizer(self) -> torch.optim.Optimizer:
        fake_mode = getattr(self.backend, "fake_mode", None)
        if fake_mode is None:
            return self.workload.new_optimizer(self.params)
        return build_with_real_constants(lambda: self.workload.new_optimizer(self.params), fake_mode)

    def _stepping(self):
        """Around every ``optimizer.step()``: what the optimizer needs to step where memory is
        counted (``counted_step``), and on fake tensors (``fake_step``)."""
        if getattr(self.backend, "fake_mode", None) is None:
            return counted_step()
        stack = contextlib.ExitStack()
        stack.enter_context(counted_step())
        stack.enter_context(fake_step(self.optimizer))
        return stack

    def _allocate_optimizer_state(self):
        # Adam-like optimizers allocate their state lazily at the first step; a trial that ran
        # without it would miss a large share of the peak. A step on zero gradients allocates it
        # without a forward pass (the probe's model is a copy, or restored afterwards).
        for p in self.params:
            p.grad = torch.zeros_like(p)
        with self._stepping():
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.backend.adopt(optimizer_state_tensors(self.optimizer))

    def _offload_shards(self):
        # FSDP2 copies each sharded gradient to the host as it assigns it, then calls the
        # parameter's post-accumulate-grad hooks.
        self.backend.offloaded(self.params)
        for p in self.params:
            p.register_post_accumulate_grad_hook(lambda p: self.backend.offloaded([p.grad]))

    def set_checkpointing(self, checkpointing) -> int:
        """Checkpoint those blocks (a ``Checkpointing``, off/on, K or a fraction) from the next
        step on; returns how many are."""
        model = eager_module(self.model)
        disable_checkpointing(model)
        request = CheckpointingRequest.parse(checkpointing, allow_auto=False)
        source = self.workload.source
        if request.value == "on":  # every block, and models' own switches (none: a WorkloadError)
            self.checkpointed_blocks = enable_checkpointing(model, source=source)
            self.checkpointing = Checkpointing.every_block(self.total_blocks or None)
            return self.checkpointed_blocks
        wanted = request.resolve(self.total_blocks, source=source)
        self.checkpointed_blocks = (enable_checkpointing(model, source=source, blocks=wanted.count)
                                    if wanted else 0)
        self.checkpointing = wanted
        return self.checkpointed_blocks

    @property
    def checkpointing_label(self) -> str:
        """"off", "on" or "K of N blocks" (before set-up counts the blocks: as asked)."""
        return self.checkpointing.label

    def _outside_budget(self):
        """For sharded sessions: what one-time setup allocates (the full model before sharding,
        FSDP2's lazy initialisation in the first step, and DTensor's first sharding propagation
        of each op, which runs the op on fake tensors of the full shape) is not held to the
        budget; what it leaves live and the measured steps are. Backends that cannot lift their
        budget (CUDA) measure it as it is."""
        unlimited = getattr(self.backend, "unlimited", None)
        return unlimited() if self.sharded and unlimited is not None else contextlib.nullcontext()

    def _check_state_fits(self):
        """What setup left live (shards, optimizer state) must fit, even where its one-time
        transients were not held to the budget."""
        tracker = getattr(self.backend, "tracker", None)
        if tracker is not None:
            tracker.check_growth(0)

    def _warm_up(self):
        out_of_memory = False
        try:
            self._step(1)
        except Exception as exc:  # noqa: BLE001 - re-raised untouched unless it is an OOM
            if not is_oom_error(exc):
                raise
            out_of_memory = True
        if out_of_memory:
            self._recover()  # not a setup failure: the search's own step at 1 reports it
        else:
            self._release_memory()

    def run(self, n: int, *, window: int = 1, micro_batches: list[int] | None = None) -> Trial:
        """One step at micro-batch ``n`` (``window=1``), or the steady state of a window of
        ``window`` accumulation steps whose micro-batches are at most ``n`` (see
        ``window_micro_batches``); ``micro_batches`` runs exactly those micro-steps instead (a
        plan's window, as ``verify`` checks it), ``n`` being the largest after the first."""
        sizes = micro_batches or self.window_micro_batches(n, window)
        self.backend.release()
        baseline = self.backend.current_bytes()
        self.backend.begin_trial()
        owned = self.backend.live_storages()
        self.backend.reset_peak()
        start = time.perf_counter()
        out_of_memory = False
        self._held = None
        graphs = graphs_compiled()
        try:
            with self._soft_budget(), deadline(self, n):  # --trial-timeout
                activation_peak, step_peak = self._window(sizes)
        except Exception as exc:  # noqa: BLE001 - an OOM is the trial's answer; others are raised
            if is_step_failure(exc):
                raise step_failed(self, exc, n) from original(exc)
            if not is_oom_error(exc):
                raise
            out_of_memory = True
        finally:
            if self.compiled:
                self.graphs_compiled += graphs_compiled() - graphs
        seconds = time.perf_counter() - start
        if out_of_memory:
            # Outside the except block: the traceback no longer pins the failed step's tensors.
            peak = self.backend.peak_bytes()
            picture = self.backend.memory_picture()
            self._recover()
            # torch can keep a failed backward's tensors alive for good (seen with HF GPT-2 under
            # non-reentrant checkpointing: held only from C++, gc finds no referrer). They are the
            # failed trial's leftovers, no part of any step: counted, they would shrink every
            # later trial's budget.
            self.backend.disown_since(owned)
            return Trial(micro_batch=n, fits=False, peak_bytes=peak, seconds=seconds,
                         baseline_bytes=baseline, gradient_bytes=self.gradient_bytes,
                         **self._window_fields(sizes), **picture)
        fits = self.backend.within_budget()
        window_fields = self._window_fields(sizes)
        if window_fields:
            # The measured micro-steps start from the first one's gradients: memory grows with n
            # from there (the search's rays start at the baseline).
            baseline = self._window_base
        measured = {"activation_peak_bytes": activation_peak, "step_peak_bytes": step_peak,
                    "baseline_bytes": baseline, "gradient_bytes": self.gradient_bytes}
        if window_fields:
            measured["held_gradient_bytes"] = window_fields.pop("held_gradient_bytes")
        if self.ranks_agree:
            fits = self._agree(measured, fits)
        return Trial(
            micro_batch=n,
            fits=fits,
            peak_bytes=max(measured["activation_peak_bytes"], measured["step_peak_bytes"]),
            seconds=seconds,
            **measured,
            **window_fields,
            **self.backend.memory_picture(),
        )

    def window_micro_batches(self, n: int, window: int) -> list[int]:
        """The micro-steps a window trial at ``n`` runs for a window of ``window`` steps.

        ``[n]`` for one step. Otherwise a first micro-step at micro-batch 1 (gradients have the
        same size at every micro-batch, so it leaves what the window's first micro-step leaves
        alive, for a fraction of the work), then the measured micro-step at ``n`` with those
        gradients alive, then the optimizer phase. Sharded with the gradients held unsharded
        until the last micro-step, a window of 3 or more also has micro-steps at ``n`` with
        sync off before the last (sync on, reduce-scattering while the unsharded gradients are
        still held): both are measured, ``[1, n, n]``.

        Why no micro-step at n without gradients is needed (the window's real first one):
        a micro-step at n run with gradients alive runs the same ops on the same activations;
        at every moment it holds what the first held, except that every gradient is there from
        the start (the first only holds those computed so far) and AccumulateGrad adds each new
        gradient in place (a transient of one parameter's gradient). So its peak is never below
        the first's: tested in tests/test_window_trial.py. Sharded with sync only on the last
        micro-step, the last one frees each block's unsharded gradients as it reduce-scatters
        them, but at the start of its backward it holds every unsharded gradient and every
        activation, which is at least what the first holds at any moment (its gradients so far
        and the activations left); ``[1, n, n]`` covers windows of three or more exactly.

        An uneven split is planned from its largest micro-batch: where that one runs only
        first (``[17, 16]``), the window trial at 17 is an upper bound of the real peak
        (``max(first at 17, second at 16)``) by at most one sample's activations."""
        if window <= 1:
            return [n]
        if self.sharded and not self.reduce_every_micro_step and window >= 3:
            return [1, n, n]
        return [1, n]

    def _window_fields(self, sizes: list[int]) -> dict:
        if len(sizes) < 2:
            return {}
        return {"micro_steps": list(sizes), "held_gradient_bytes": self._held}

    def _soft_budget(self):
        unlimited = getattr(self.backend, "unlimited", None)
        if not self.ranks_agree or unlimited is None:
            return contextlib.nullcontext()
        return unlimited(ceiling=int(self.backend.budget_bytes * _SOFT_CEILING))

    def _agree(self, measured: dict, fits: bool) -> bool:
        """Whether every rank fitted (its budget was lifted); ``measured`` becomes every rank's
        largest value of each. Everything the search reads is agreed, not only the peaks: a
        rank's own baseline differs by the buffers gloo's threads hold, and a search fed one
        rank's baseline can take another step than its peers (seen in CI: 13 on one rank, 12
        on the other, after the same agreed peaks)."""
        fits = fits and max(measured["activation_peak_bytes"],
                            measured["step_peak_bytes"]) <= self.backend.budget_bytes
        keys = sorted(measured)  # the same keys on every rank: the same tensor to reduce
        values = max_across_ranks([-1 if measured[k] is None else measured[k] for k in keys]
                                  + [0 if fits else 1])
        measured.update((k, None if v < 0 else v) for k, v in zip(keys, values))
        return values[-1] == 0

    def _step(self, n: int) -> tuple[int, int]:
        return self._window([n])

    def steady_state(self, *, pipelined: bool = False):
        """A context around the part of a window that is steady state (a pipeline's window after
        its schedule's first; a step count records there, ``timing.count``): nothing here.
        ``pipelined``: a schedule interleaves micro-steps' forwards and backwards."""
        return contextlib.nullcontext()

    def _window(self, sizes: list[int]) -> tuple[int, int]:
        """The micro-steps (gradients accumulating; sharded, synced on the last, or on every one
        under ``reduce_every_micro_step``), then the optimizer phase; (activation, step) peaks."""
        last = len(sizes) - 1
        # The loop's window totals (loss sum, items, noise scale), alive through its window.
        self._totals = WindowTotals(self.device)
        try:
            for index, size in enumerate(sizes):
                self._gradient_sync(index == last or self.reduce_every_micro_step)
                batch = move_batch(self.workload.batch(size), self.device)
                if self.compiled:
                    mark_batch_dynamic(batch)
                activation_peak = self._forward_backward(batch)
                if index < last:
                    del batch
                if index == 0 and last:
                    # What the window's first micro-step leaves for the others: its gradients
                    # (unsharded under FSDP2 with sync off, sharded when it reduce-scatters).
                    self._held = self._gradient_bytes_held()
                    self._window_base = self.backend.current_bytes()
                    if size < max(sizes):
                        # A stand-in at a smaller micro-batch: what a modelled allocator caches
                        # for it is no part of the real window (see release_cached).
                        self.backend.release_cached()
        finally:
            self._gradient_sync(True)
        self.backend.reset_peak()
        with self.backend.on_host() if self.offload else contextlib.nullcontext():
            step_peak = self._optimizer_phase()  # the batch is still alive here, as in training
        del batch
        self._totals = None
        return activation_peak, step_peak

    def _gradient_bytes_held(self) -> int:
        grads = [_local(p.grad) for p in self.params if p.grad is not None]
        if self.sharded:
            from ..distributed.sharding.wrap import local_unsharded_grads

            grads += local_unsharded_grads(self.model)
        storages = {g.untyped_storage()._cdata: g.untyped_storage().nbytes() for g in grads}
        return sum(storages.values())

    def _gradient_sync(self, enabled: bool) -> None:
        if self.sharded:
            from ..distributed.sharding.wrap import set_gradient_sync

            set_gradient_sync(self.model, enabled)

    def _forward_backward(self, batch) -> int:
        """Forward under the precision and backward, as the training loop runs them (its summed
        loss scaled for the window, added to the window's totals after); the peak of the
        phase."""
        with autocast(self.precision, self.device):
            loss, count = self.workload.loss(self.model, batch)
        # The loop's own scalars are part of its peak: a plan measured without them was 32 bytes
        # short of training's (HF GPT-2 on padded batches). The values do not matter here.
        loss_sum, items = summed_loss(loss, count, 1)
        self.scaler.scale(loss_sum * 1.0).backward()
        if self._totals is not None:
            self._totals.add(loss_sum, items, counted=count is not None)
        del loss, loss_sum, items
        return self.backend.peak_bytes()

    def _optimizer_phase(self) -> int:
        """unscale_, clip, optimizer step, update, zero_grad; the peak since the last reset."""
        self.scaler.unscale_(self.optimizer)
        clip_grad_norm_(self.params, CLIP_NORM)
        self._optimizer_step()
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return self.backend.peak_bytes()

    def _optimizer_step(self):
        # optimizer.step() directly, not scaler.step(): a real fp16 step that found inf would be
        # skipped, and the probe must still measure what the optimizer step costs.
        with self._stepping():
            self.optimizer.step()

    def _release_memory(self):
        free_memory()
        self.backend.release()

    def _recover(self):
        self.optimizer.zero_grad(set_to_none=True)
        if self.sharded:
            # A window that failed with gradient sync off leaves FSDP2's unsharded gradients.
            from ..distributed.sharding.wrap import drop_unsharded_grads

            drop_unsharded_grads(self.model)
        # A step can fail between unscale_ and update; a fresh scaler forgets that half-done step.
        self.scaler = grad_scaler(self.precision, self.device)
        free_memory()
        self.backend.release()

    def _teardown(self):
        try:
            if self.optimizer is not None:
                self.optimizer.zero_grad(set_to_none=True)
                self.optimizer = None
            if self.model is not None:
                if self.checkpointing:
                    disable_checkpointing(eager_module(self.model))
                if self._saved is not None:
                    _restore_module_state(self.model, self._saved)
            self.model = None
            self.params = []
            self._release_memory()
        finally:
            self._tracking.__exit__(None, None, None)
            # Outside tracking, like the backup: restoring is no part of a step's memory.
            if self._saved is not None:
                saved, self._saved = self._saved, None
                _restore_module_state(self.workload.model, saved)


_SOFT_CEILING = 2.0
"""How far past its budget a trial of ranks that agree may go before the error is raised: a
search's next trial at most doubles the activations of one that fitted."""


def _local(p: torch.Tensor) -> torch.Tensor:
    """A sharded parameter's (DTensor's) shard on this rank; a plain tensor itself."""
    return p.to_local() if hasattr(p, "to_local") else p


def optimizer_state_tensors(optimizer: torch.optim.Optimizer):
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                yield value


def _save_module_state(model: torch.nn.Module) -> dict:
    """Everything a probe changes on a module instance, copied to the CPU (a compiled
    instance's: its eager module's, under the keys ``_restore_module_state`` reads)."""
    model = eager_module(model)
    first = next(iter(model.parameters()), None)
    return {
        "device": first.device if first is not None else torch.device("cpu"),
        "training": {name: m.training for name, m in model.named_modules()},
        "state": {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()},
        "grads": {name: (p.grad.detach().to("cpu", copy=True) if p.grad is not None else None)
                  for name, p in model.named_parameters()},
    }


def _restore_module_state(model: torch.nn.Module, saved: dict) -> None:
    model = eager_module(model)
    model.to(saved["device"])
    with torch.no_grad():
        model.load_state_dict(saved["state"])
    for name, module in model.named_modules():
        module.training = saved["training"].get(name, module.training)
    for name, p in model.named_parameters():
        grad = saved["grads"].get(name)
        p.grad = grad.to(p.device) if grad is not None else None
