"""Pipeline parallelism: the model cut at its repeated blocks into stages, run by torch's schedules.

The stages are the blocks activation checkpointing wraps (``repeated_blocks``), split evenly into
``pp × stages_per_rank`` consecutive runs; what runs before the first block (the embedding) goes
with the first stage, what runs after the last (the head and the loss) with the last. A rank holds
its stages: ``pp_rank, pp_rank + pp, ...`` (the loop placement of torch's interleaved schedules).

Each stage is a copy of the whole model in which every block outside the stage is replaced by a
pass-through module and every parameter outside it by a zero-stride placeholder of its shape (4
bytes), and the user's own ``loss_fn(model, batch)`` runs on it: the prefix runs as the model
runs it (on a later stage only to rebuild the blocks' other arguments, masks or rotary tables,
while its placeholders' outputs are dropped), the received activation replaces the stage's first
block's input, and the forward stops at the stage's last block (``_Boundary``), or, on the last
stage, goes on to the loss. So any model whose blocks take the hidden state first and return it
is cut without the model file saying how, and the memory a stage holds is the memory its rank
holds: the estimate runs the same code on fake tensors with a fake process group.

torch's ``PipelineStage`` needs the activations' shapes ahead: they come from a run of a
placeholder copy of the whole model on fake tensors (``_ShapeModel``), once per shape of the
micro-batches; a window's micro-batches must share one shape.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import warnings

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from ..errors import ConfigError, LayoutUnsupported, given, option
from ..workload.activation_checkpointing import repeated_blocks
from ..workload.adapters import prefix_tuned
from .layout import Layout, PipelineSchedule


def _schedule_class(schedule: PipelineSchedule):
    from torch.distributed import pipelining

    return {PipelineSchedule.ONE_F_ONE_B: pipelining.Schedule1F1B,
            PipelineSchedule.INTERLEAVED_1F1B: pipelining.ScheduleInterleaved1F1B,
            PipelineSchedule.ZERO_BUBBLE: pipelining.ScheduleInterleavedZeroBubble}[schedule]


def stage_bounds(blocks: int, stages: int) -> list[tuple[int, int]]:
    """The blocks [start, end) of each of ``stages`` stages, as even as the count allows."""
    edges = [i * blocks // stages for i in range(stages + 1)]
    return list(zip(edges, edges[1:]))


def rank_stage_ids(pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """The stages a rank holds (loop placement: ``pp_rank + k·pp``)."""
    return [pp_rank + k * pp for k in range(stages_per_rank)]


def block_container(model: torch.nn.Module, *, source: str = "model") -> torch.nn.Module:
    """The one ModuleList/Sequential whose children are the model's repeated blocks."""
    blocks = repeated_blocks(model)
    for module in model.modules():
        if (isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)) and len(module) == len(blocks)
                and len(blocks) >= 2 and all(a is b for a, b in zip(module, blocks))):
            return module
    raise LayoutUnsupported(f"{source}: pipeline parallelism splits the model at its repeated blocks (one "
                            f"nn.ModuleList or nn.Sequential of layers), and this model has "
                            f"{'none' if not blocks else 'them in several containers'}; train it without --pp",
                            degree="pp")


class _Boundary(BaseException):
    """Raised at a stage's last block with its output (a BaseException: the user's code and
    autotune's ``user_code`` wrapper let it through)."""

    def __init__(self, output):
        super().__init__()
        self.output = output


class _Skip(torch.nn.Module):
    """A block of another stage: hands its hidden state on untouched (no compute, no memory)."""

    def forward(self, hidden, *args, **kwargs):
        return hidden


class _Phases(TorchFunctionMode):
    """Which parameters the forward reads before the first block, inside blocks, after the last."""

    def __init__(self, params: dict[int, str]):
        super().__init__()
        self.params = params
        self.phase = "prefix"
        self.seen: dict[str, set[str]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        for leaf in pytree.tree_leaves((args, kwargs or {})):
            name = self.params.get(id(leaf))
            if name is not None:
                self.seen.setdefault(name, set()).add(self.phase)
        return func(*args, **(kwargs or {}))


def parameter_phases(model, container, loss, batch, *, source: str = "model") -> dict[str, str]:
    """"prefix" or "suffix" for each parameter outside the blocks (by name): where the forward
    reads it, on fake tensors. A parameter read on both sides (weights tied between the embedding
    and the head) cannot live on one stage: an error."""
    blocks = {id(p) for p in container.parameters()}
    names = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in blocks:
            names.setdefault(id(p), name)
    mode = _Phases(names)
    enter = container[0].register_forward_pre_hook(lambda *_: setattr(mode, "phase", "blocks"))
    leave = container[len(container) - 1].register_forward_hook(lambda *_: setattr(mode, "phase", "suffix"))
    try:
        with torch.no_grad(), _fake_mode(), mode:
            loss(model, batch)
    finally:
        enter.remove()
        leave.remove()
    phases = {}
    for pid, name in names.items():
        seen = mode.seen.get(name, {"prefix"}) - {"blocks"}
        if seen == {"prefix", "suffix"}:
            raise LayoutUnsupported(f"{source}: parameter {name} is read both before the first block "
                                    f"and after the last (tied weights?), so no single pipeline stage "
                                    f"can hold it; untie it (e.g. tie_word_embeddings=False) to train "
                                    f"with --pp", degree="pp")
        phases[name] = seen.pop() if seen else "prefix"
    return phases


def _fake_mode():
    """Fake tensors for a run that must allocate nothing: the fake mode in force (the estimate's,
    counting nothing meanwhile: a real run's own fake mode allocates nothing, and the estimate
    counted the shape inference's whole-model forward into a pipeline's first window, 9.9 GiB of
    logits on every rank of Llama 8B at sequence 8192), else a new one that takes the real
    model's tensors as inputs."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = detect_fake_mode()
    if mode is not None:
        return getattr(mode, "uncounted", contextlib.nullcontext)()
    return FakeTensorMode(allow_non_fake_inputs=True)


def _placeholder(p: torch.Tensor) -> torch.Tensor:
    return torch.empty((), dtype=p.dtype, device=p.device).expand(p.shape)


def _replace_with_placeholder(model: torch.nn.Module, name: str) -> None:
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner)
    p = getattr(module, leaf)
    delattr(module, leaf)
    setattr(module, leaf, _placeholder(p))  # a plain attribute: no parameter, never trained


class StageModule(torch.nn.Module):
    """One pipeline stage: the model with the other stages' blocks and parameters left out.

    ``forward(*received, micro_batch=i)`` runs the window's loss (``loss``) on its micro-batch
    ``i`` (``batches``), with ``received`` (the previous stage's activation) in place of the first
    block's input; it returns the last block's output, or on the last stage ``weigh(loss,
    count, i)``: the loss to backpropagate (see ``PipelinedModel.run``).
    """

    def __init__(self, model, *, start: int, end: int, first: bool, last: bool, source: str):
        super().__init__()
        self.model = model
        self.start, self.end, self.first, self.last = start, end, first, last
        self._source = source
        self.batches: list = []
        self.weigh = None
        self.loss = None
        """The workload's loss as this window's step runs it (``PipelinedModel.run``)."""
        self._received = None
        self.sequence_mesh = None
        """The tensor-parallel mesh under sequence parallel: the stream between blocks is a DTensor
        sharded by sequence over it, and a stage sends and receives its local share."""
        container = block_container(model, source=source)
        if not first:
            container[start].register_forward_pre_hook(self._swap_input)
        if not last:
            container[end - 1].register_forward_hook(self._stop)

    def _swap_input(self, module, args):
        if self._received is None:
            return None
        received = self._received
        if self.sequence_mesh is not None:
            from torch.distributed.tensor import DTensor, Shard

            received = DTensor.from_local(received, self.sequence_mesh, [Shard(1)], run_check=False)
        return (received, *args[1:])

    def _stop(self, module, args, output):
        if self.sequence_mesh is not None and hasattr(output, "to_local"):
            output = output.to_local()
        raise _Boundary(output)

    def forward(self, *received, micro_batch: int):
        self._received = None if self.first else received[0]
        try:
            loss, count = self.loss(self.model, self.batches[micro_batch])
        except _Boundary as boundary:
            output = boundary.output
            if not isinstance(output, torch.Tensor):
                raise LayoutUnsupported(f"{self._source}: block {self.end - 1} returned "
                                        f"{type(output).__name__}; pipeline stages hand on one tensor "
                                        f"(a block that returns its hidden state)", degree="pp") from None
            return output
        finally:
            self._received = None
        return self.weigh(loss, count, micro_batch)


class _ShapeModel:
    """A copy of the whole model with every parameter a placeholder: run on fake tensors, it gives
    the shape of each stage's output for a micro-batch, allocating nothing."""

    def __init__(self, model, container_path: str, ends: list[int], loss):
        self.model = _deepcopy(model, fake_modes_kept(model))
        for name, _ in list(self.model.named_parameters()):
            _replace_with_placeholder(self.model, name)
        self.container = self.model.get_submodule(container_path) if container_path else self.model
        self.ends = ends
        self.loss = loss

    def outputs(self, batch) -> dict[int, tuple]:
        found = {}

        def record(end):
            def hook(module, args, out):
                found.setdefault(end, (tuple(out.shape), out.dtype))
            return hook

        hooks = [self.container[end - 1].register_forward_hook(record(end)) for end in self.ends]
        try:
            with torch.no_grad(), _fake_mode():
                self.loss(self.model, batch)
        finally:
            for hook in hooks:
                hook.remove()
        return found


class PipelinedModel(torch.nn.Module):
    """A rank's stages (submodules ``stage_<id>``) and the schedule that runs them.

    ``parameters()`` are this rank's own; ``run(batches, weigh)`` runs one window of
    micro-batches through the pipeline (forward and backward of every stage), leaving the
    window's gradients in the stages' parameters.
    """

    def __init__(self, stages: dict[int, StageModule], *, num_stages: int, schedule: PipelineSchedule,
                 group, device, shape_model: _ShapeModel, bounds: list[tuple[int, int]], autocast=None,
                 split_sequence: tuple[int, int] = (1, 1)):
        super().__init__()
        self.split_sequence = split_sequence
        """(cp, tp): the ranks a stage's output is split over by sequence (``build_pipeline``)."""
        for stage_id, module in stages.items():
            self.add_module(f"stage_{stage_id}", module)
        self.stage_ids = list(stages)
        self.num_stages = num_stages
        self.schedule = schedule
        self.group = group
        self.device = device
        self.bounds = bounds
        self._shapes = shape_model
        self._built = None
        self.autocast = autocast or contextlib.nullcontext

    def to(self, *args, **kwargs):
        """The stages were built on ``device`` (``build_pipeline`` moves the model before cutting
        it: the placeholders, plain attributes, would not move with it): a no-op."""
        return self

    @property
    def stages(self) -> list[StageModule]:
        return [getattr(self, f"stage_{i}") for i in self.stage_ids]

    @property
    def holds_last_stage(self) -> bool:
        return self.num_stages - 1 in self.stage_ids

    def prepare(self, batches) -> bool:
        """Build the stages and the schedule for windows like ``batches`` (their count and
        shape); True when they are new: their first window also allocates the stages' receive
        buffers and sets up FSDP2, which later windows reuse."""
        built = self._built
        self._schedule_for(batches)
        return built is not self._built

    def _schedule_for(self, batches):
        from torch.distributed.pipelining import PipelineStage

        signature = [_batch_signature(b) for b in batches]
        if any(s != signature[0] for s in signature):
            raise ConfigError("a pipelined window's micro-batches must share one shape (torch's "
                              "pipeline schedules receive into buffers of a fixed shape); plan with "
                              "--even and a batch that fills every window")
        key = (len(batches), signature[0])
        if self._built is not None and self._built[0] == key:
            return self._built[1]
        with self.autocast():
            shapes = {end: self._share(shape, dtype) for end, (shape, dtype) in
                      self._shapes.outputs(batches[0]).items()}
        pipeline_stages = []
        for stage_id, module in zip(self.stage_ids, self.stages):
            start, end = self.bounds[stage_id]
            received = (None if module.first
                        else _example(*shapes[self.bounds[stage_id - 1][1]], grad=True))
            sent = None if module.last else _example(*shapes[end])
            pipeline_stages.append(PipelineStage(
                module, stage_id, self.num_stages, self.device,
                input_args=torch.empty(1, device="meta") if module.first else received,
                output_args=torch.empty((), device="meta") if module.last else sent,
                input_grads=None if module.first else received,
                output_grads=None if module.last else sent,
                group=self.group))
        schedule_class = _schedule_class(self.schedule)
        stages_arg = pipeline_stages if self.schedule.interleaved else pipeline_stages[0]
        try:
            schedule = schedule_class(stages_arg, len(batches), loss_fn=_backpropagated,
                                      scale_grads=False)
        except ValueError as exc:
            raise ConfigError(f"the {self.schedule.value} schedule cannot run a window of "
                              f"{len(batches)} micro-batch(es) over {self.num_stages} stages ({exc}); "
                              f"use {option('accumulation_steps')} of at least "
                              f"{self.num_stages // len(self.stage_ids)} (the pipeline degree)") from exc
        self._built = (key, schedule)
        return schedule

    def _share(self, shape: tuple, dtype) -> tuple:
        """A stage output's (shape, dtype) as one rank sends it: under context parallelism and
        sequence parallel, its share of the sequence (dim 1)."""
        cp, tp = self.split_sequence
        if cp * tp == 1:
            return shape, dtype
        # Context parallel cuts each sequence into 2 × cp load-balanced chunks, sequence parallel
        # a cp rank's share into tp.
        need = math.lcm(2 * cp, cp * tp) if cp > 1 else tp
        if len(shape) < 2 or shape[1] % need:
            split = " × ".join(f"{name} {n}" for name, n in (("cp", cp), ("tp", tp)) if n > 1)
            raise ConfigError(f"a pipeline stage's output of shape {list(shape)} cannot be split by "
                              f"sequence (dim 1) over {split} ranks: this pipeline needs a sequence "
                              f"length divisible by {need}; use another --seq-len, or other degrees")
        return (shape[0], shape[1] // (cp * tp), *shape[2:]), dtype

    def run(self, batches: list, weigh, loss) -> None:
        """Forward and backward of ``batches`` (this window's micro-batches, the same on every
        rank of the pipeline). ``loss(model, batch) -> (loss, count)``: the workload's loss as this
        step runs it (the training loop builds the model first, then enters context parallelism's
        step, which shards each batch's sequence, around its runs). ``weigh(loss, count, index)``
        turns the last stage's loss of micro-batch ``index`` into the tensor to backpropagate."""
        schedule = self._schedule_for(batches)
        for module in self.stages:
            module.batches, module.weigh, module.loss = batches, weigh, loss
        count = len(batches)
        try:
            with self.autocast():
                _step_unwrapping_oom(schedule,arg_mbs=[(torch.zeros(1, device=self.device),)] * count,
                              kwarg_mbs=[{"micro_batch": i} for i in range(count)],
                                     target_mbs=[None] * count, return_outputs=False)
        finally:
            for module in self.stages:
                module.batches, module.weigh, module.loss = [], None, None
            for stage in schedule._stages if hasattr(schedule, "_stages") else [schedule._stage]:
                _drop_chunks(stage)


def fake_pipeline_supported() -> bool:
    """Whether this torch's schedules run on fake tensors (torch 2.14: ``step`` takes split
    micro-batches; 2.13's first step votes between ranks with a tensor's value, ``.item()``)."""
    from torch.distributed.pipelining import Schedule1F1B

    return "arg_mbs" in inspect.signature(Schedule1F1B.step).parameters


def _step_micro_batches(schedule, *, arg_mbs, kwarg_mbs, target_mbs, return_outputs) -> None:
    """``schedule.step`` on micro-batches already split. torch 2.14's ``step`` takes them
    (``arg_mbs``...); 2.13's (the floor) splits a whole batch itself, so its own steps before
    the split are done here and the micro-batches go to ``_step_microbatches``."""
    if fake_pipeline_supported():
        schedule.step(arg_mbs=arg_mbs, kwarg_mbs=kwarg_mbs, target_mbs=target_mbs,
                      return_outputs=return_outputs)
        return
    from torch._subclasses.fake_tensor import FakeTensor

    if any(isinstance(t, FakeTensor) for args in arg_mbs for t in args):
        raise ConfigError(f"a pipeline's memory is estimated on fake tensors by torch 2.14 or later: "
                          f"torch {torch.__version__}'s schedules read a tensor's value in their first "
                          f"step; upgrade torch, or probe the pipeline under torchrun with real ranks")
    for stage in schedule._stages if hasattr(schedule, "_stages") else [schedule._stage]:
        stage.has_backward = schedule._has_backward
        stage.clear_runtime_states()
    schedule._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, None, return_outputs)


def _step_unwrapping_oom(schedule, **kwargs) -> None:
    """``schedule.step``, with an out-of-memory error raised as itself: the stage wraps whatever
    its forward or backward raised in a RuntimeError of its own ("failed to run forward"),
    which no out-of-memory handler would recognise."""
    from ..memory.oom import is_oom_error

    try:
        _step_micro_batches(schedule, **kwargs)
    except Exception as exc:  # noqa: BLE001 - re-raised, or its out-of-memory cause instead
        cause = exc
        while cause is not None and not is_oom_error(cause):
            cause = cause.__cause__ or cause.__context__
        if cause is None or cause is exc:
            raise
        raise cause from None


def _drop_chunks(stage) -> None:
    # The stage keeps the last window's outputs for merging (return_outputs) and its forward
    # caches until the next step; holding them past the window would count in no step's peak.
    stage.output_chunks.clear()
    stage.fwd_cache.clear()


def _backpropagated(output, target):
    return output


def _example(shape, dtype, *, grad: bool = False) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=grad)


def _batch_signature(batch) -> tuple:
    return tuple((tuple(leaf.shape), leaf.dtype) if isinstance(leaf, torch.Tensor) else repr(leaf)
                 for leaf in pytree.tree_leaves(batch))


def build_pipeline(model: torch.nn.Module, *, pp: int, pp_rank: int, stages_per_rank: int = 1,
                   schedule="1f1b", loss, example_batch, group=None, device=None, shard=None, autocast=None, source: str = "model",
                   split_sequence: tuple[int, int] = (1, 1)) -> PipelinedModel:
    """This rank's stages of ``model`` (which it consumes), ready to ``run``.

    ``loss(model, batch) -> (loss, count)``: the workload's loss on whole sequences, on which
    which parameters run before the first block and after the last, and the activations' shapes,
    are read, on fake tensors from ``example_batch`` (a micro-batch the forward can read); each
    ``run`` hands the stages the loss its step runs. ``shard(stage_module)`` (FSDP2 over the data-parallel ranks) is
    applied to each stage. ``split_sequence``: (cp, tp) ranks a stage's output is split over by
    sequence (context parallel, then tp under sequence parallel; (1, 1): whole), each rank
    sending and receiving its share.
    """
    layout = Layout(pp=pp, pp_schedule=schedule, stages_per_rank=stages_per_rank)
    schedule = layout.pp_schedule
    if device is not None:
        model = model.to(device)
    container = block_container(model, source=source)
    if prefix_tuned(model):
        raise LayoutUnsupported(f"{source}: peft's prefix tuning hands every layer its prefix through "
                                f"the key-value cache, and pipeline stages hand on one tensor (the "
                                f"hidden state); train it without --pp", degree="pp")
    layout.check_model(blocks=len(container))
    num_stages = pp * stages_per_rank
    bounds = stage_bounds(len(container), num_stages)
    phases = parameter_phases(model, container, loss, example_batch, source=source)
    path = next(name for name, module in model.named_modules() if module is container)
    shapes = _ShapeModel(model, path, [end for _, end in bounds], loss)
    ids = rank_stage_ids(pp_rank, pp, stages_per_rank)
    stages = {}
    for k, stage_id in enumerate(ids):
        copy_ = model if k == len(ids) - 1 else _copy_model(model)
        start, end = bounds[stage_id]
        first, last = stage_id == 0, stage_id == num_stages - 1
        _cut(copy_, path, start, end, phases, first=first, last=last)
        module = StageModule(copy_, start=start, end=end, first=first, last=last, source=source)
        stages[stage_id] = shard(module) if shard is not None else module
    device = device or torch.device("cpu")
    return PipelinedModel(stages, num_stages=num_stages, schedule=schedule, group=group, device=device,
                          shape_model=shapes, bounds=bounds, autocast=autocast, split_sequence=split_sequence)


def _copy_model(model: torch.nn.Module) -> torch.nn.Module:
    """``copy.deepcopy(model)``, its fake parameters and buffers cloned by an op instead. A
    deep-copied FakeTensor's views report another storage than the tensor itself, so the estimate
    counted the views of a copied stage's weights that its forward saves for backward (a
    ``weight.t()`` per linear) as weight-sized storages of their own: interleaved 1F1B, whose
    ranks copy the model for every stage but their last, was over by one block's weights (+2.2%
    to +4.3% on tiny_lm). Real tensors are deep-copied as they were; tied weights stay tied."""
    from torch._subclasses.fake_tensor import is_fake

    memo = fake_modes_kept(model)
    for tensor in (*model.parameters(), *model.buffers()):
        if id(tensor) in memo or not is_fake(tensor):
            continue
        with torch.no_grad():
            clone = tensor.detach().clone()
        memo[id(tensor)] = (torch.nn.Parameter(clone, requires_grad=tensor.requires_grad)
                            if isinstance(tensor, torch.nn.Parameter) else clone)
    return _deepcopy(model, memo)


def _deepcopy(model: torch.nn.Module, memo: dict) -> torch.nn.Module:
    """``copy.deepcopy(model, memo)`` without torch's warning about a FakeTensor's data pointer:
    ``Tensor.__deepcopy__`` reads it only to tell a storage-less tensor apart, and the warning
    ("almost definitely a bug in your code") reached the user's terminal from every pipeline
    estimate, about no code of theirs."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor",
                                category=UserWarning)
        return copy.deepcopy(model, memo)


def fake_modes_kept(model: torch.nn.Module) -> dict:
    """A ``copy.deepcopy`` memo under which the copy's fake tensors stay in the fake modes of the
    model's own. Deep-copying a FakeTensor copies its ``__dict__``, its ``fake_mode`` with it: a
    second FakeTensorMode whose converter holds a copy of each ``StorageWeakRef`` of the first's
    constants (``torch.tensor(...)`` in a forward) with the same weak pointer and no reference of
    its own. Both free it (``StorageWeakRef.__del__``), one weak reference too many, and the
    second decrement writes into a freed ``StorageImpl``: glibc aborted ("corrupted
    double-linked list") or segfaulted at a later allocation, one or two pipeline probes into a
    process (valgrind: THPStorage_freeWeakRef reading a block a previous call freed). A
    pipeline's stages and shape model are copies of the fake model."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    def fake_modes(tensor):
        if isinstance(tensor, FakeTensor):
            yield tensor.fake_mode
        elif is_traceable_wrapper_subclass(tensor):  # a DTensor: its local shard is the fake one
            for name in tensor.__tensor_flatten__()[0]:
                yield from fake_modes(getattr(tensor, name))

    memo = {}
    for module in model.modules():
        for tensor in (*module._parameters.values(), *module._buffers.values(),
                       *(v for v in vars(module).values() if isinstance(v, torch.Tensor))):
            for mode in fake_modes(tensor):
                memo[id(mode)] = mode
    return memo


def _cut(model, path: str, start: int, end: int, phases: dict[str, str], *, first: bool,
         last: bool) -> None:
    container = model.get_submodule(path) if path else model
    for i in range(len(container)):
        if not start <= i < end:
            container[i] = _Skip()
    wanted = ({"prefix"} if first else set()) | ({"suffix"} if last else set())
    for name, phase in phases.items():
        if phase not in wanted:
            with contextlib.suppress(AttributeError):
                _replace_with_placeholder(model, name)


def pipeline_model(model: torch.nn.Module, *, mesh, parallel, sharding, precision, workload) -> PipelinedModel:
    """``apply_layout``'s pipeline: this rank's stages of ``model`` on ``mesh`` (its "pp" dim;
    the rank's place along it picks the stages), each split as ``split_stage`` says
    (tensor parallel, then FSDP2 over the data-parallel dims)."""
    from ..precision import Precision, autocast
    from .context_parallel import whole_sequence_loss
    from .sharding.settings import Sharding
    from .sharding.wrap import layout_fsdp_mesh

    if workload is None or workload.model_is_instance:
        raise ConfigError("pipeline parallelism needs a model file's build_model(): it cuts the model")
    sharding, precision = Sharding.parse(sharding), Precision.parse(precision)
    if precision is Precision.FP16:
        # Each rank's GradScaler finds inf/NaN in its own stages' gradients only; the stages
        # would skip different steps and drift apart.
        raise ConfigError(f"{given('precision', 'fp16')} with {option('pp')} {parallel.pp}: fp16's "
                          f"GradScaler skips steps rank by rank, and a pipeline's stages must skip "
                          f"together; use bf16 or fp32")
    dp_mesh = layout_fsdp_mesh(mesh, parallel)
    device = torch.device(mesh.device_type)

    tp_plan = None
    if parallel.tp > 1:
        from .tensor_parallel import layout_plan

        tp_plan = layout_plan(model, workload=workload, parallel=parallel, sharding=sharding)

    def shard(module):
        return split_stage(module, mesh=mesh, parallel=parallel, sharding=sharding, precision=precision,
                           dp_mesh=dp_mesh, tp_plan=tp_plan)

    # Under context parallelism a stage's loss shards each micro-batch's sequence over the cp
    # ranks (``context_parallel_step`` made it so); its shapes and parameters' phases are read
    # from the whole sequence, each rank then sending its share: of the cp ranks', and of the
    # tp ranks' under sequence parallel.
    sequence_parallel = tp_plan is not None and bool(tp_plan.norms)
    return build_pipeline(model, pp=parallel.pp, pp_rank=mesh.get_local_rank("pp"),
                          stages_per_rank=parallel.stages_per_rank, schedule=parallel.pp_schedule.value,
                          loss=whole_sequence_loss(workload),
                          example_batch=workload.batch(1), group=mesh["pp"].get_group(), device=device,
                          shard=shard, split_sequence=(parallel.cp, parallel.tp if sequence_parallel else 1),
                          autocast=lambda: autocast(precision, device), source=workload.source)


def split_stage(module: torch.nn.Module, *, mesh, parallel: Layout, sharding, precision, dp_mesh,
                tp_plan=None) -> torch.nn.Module:
    """A pipeline stage (``StageModule``) as ``apply_layout`` splits a whole model:
    ``tp_plan`` (the whole model's ``tensor_parallel.layout_plan``) on ``mesh["tp"]`` over the
    part the stage holds (its model is the model file's own with the other stages' blocks cut
    out, so the plan's module names are the model's); under sequence parallel the stage hands on
    and receives its rank's share of the sequence. Then FSDP2 over ``dp_mesh`` where it has more
    than one rank, or where tensor parallel leaves some parameters plain (as ``apply_layout``
    does: one optimizer step over DTensors and plain tensors mixed is refused by its foreach
    ops). Otherwise one data-parallel rank skips FSDP2, which would only add a gathered copy of
    every block."""
    from .sharding.settings import Sharding
    from .sharding.wrap import shard_model

    sharding = Sharding.parse(sharding)
    if tp_plan is not None:
        from .tensor_parallel import apply_plan, held_part

        module.model = apply_plan(module.model, mesh, held_part(tp_plan, module.model))
        if tp_plan.norms:
            module.sequence_mesh = mesh["tp"]
    if sharding.sharded and (dp_mesh.size() > 1 or parallel.tp > 1):
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        # As apply_layout: FSDP2 joins the dp and tp meshes, with a data-dependent op on the mesh.
        with unset_fake_temporarily():
            shard_model(module, mesh=dp_mesh, sharding=sharding, precision=precision)
    return module


class _HeldWork:
    """A point-to-point work that keeps its tensors alive as long as the schedule keeps it."""

    def __init__(self, work, tensors):
        self._work = work
        self._tensors = tensors

    def wait(self, *args, **kwargs):
        return self._work.wait(*args, **kwargs)


@contextlib.contextmanager
def sends_held_by_their_work():
    """On the fake process group a send is done at once and its work holds nothing; gloo's work
    holds the sent tensor until the schedule drops the work (1F1B keeps the last send's work
    until the next send, the interleaved schedules every send's until the end of the window),
    so a sent input gradient outlives the backward that made it. Here every work holds its
    tensors, as gloo's do."""
    from torch.distributed.pipelining import schedules

    original = schedules._batch_p2p

    def batch_p2p(p2p_ops, desc=None):
        import torch.distributed as dist

        tensors = [op.tensor for op in p2p_ops if op.op is dist.isend]
        return [_HeldWork(work, tensors) for work in original(p2p_ops, desc=desc)]

    schedules._batch_p2p = batch_p2p
    try:
        yield
    finally:
        schedules._batch_p2p = original


def pipeline_grad_norm(params, group, *, max_norm: float | None = None) -> torch.Tensor:
    """The gradient norm over every stage's parameters (each rank holds its own stages'), clipped
    to ``max_norm`` when given, as ``clip_grad_norm_`` over the whole model would."""
    import torch.distributed as dist

    from .tensor_parallel import clip_grad_norm_, grads_by_mesh

    params = [p for p in params if p.grad is not None]
    # This rank's stages' norm, whole over tensor-parallel shards (each mesh's on its own).
    local = clip_grad_norm_(params, None) if params else torch.zeros(())
    squared = local.to(torch.float64) ** 2
    dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=group)
    norm = squared.sqrt().to(local.dtype)
    if max_norm is not None and params:
        # As clip_grad_norm_ scales (never up); a number, which DTensor gradients take too; one
        # foreach per mesh (a foreach op does not mix DTensors of different meshes).
        coefficient = min(1.0, max_norm / (float(norm) + 1e-6))
        for grads in grads_by_mesh(params):
            torch._foreach_mul_(grads, coefficient)
    return norm


__all__ = ["PipelinedModel", "StageModule", "block_container", "build_pipeline", "fake_modes_kept", "parameter_phases", "pipeline_grad_norm", "pipeline_model", "rank_stage_ids",
           "sends_held_by_their_work", "split_stage", "stage_bounds"]
