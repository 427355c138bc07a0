"""Tensor parallelism (with sequence parallelism where the plan asks for it) on a mesh's "tp" dim.

Where a model's TP plan comes from, first found wins:

1. the model file's ``parallelize(model, mesh)``: it applies its own layout (``mesh`` is the
   whole device mesh; its ``"tp"`` dim is the tensor-parallel one) and returns the model or None;
2. the model file's ``TP_PLAN``: module-name patterns (``*`` matches one name part, as in
   ``"layers.*.mlp.up_proj"``) to a style: a ``ParallelStyle`` or one of ``STYLE_NAMES``;
3. a Hugging Face model's own plan (``model.tp_plan``: its config's ``base_model_tp_plan`` and
   the head's), its strings mapped to ``torch.distributed.tensor.parallel`` styles;
4. a plan derived from the common transformer block: q/k/v (colwise) and o (rowwise) projections,
   gate/up (colwise) and down (rowwise) projections, and an MLP of Linear, activation, Linear
   (colwise then rowwise), each pair checked by shape.

A model with none of these is a ``ConfigError`` naming the ways; a degree that does not divide
the attention heads (or KV heads, or a sharded dimension) is one naming the limit. The same
function applies the layout in the estimate (fake process group), the probe and the training loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re

import torch
from torch import nn

from ..errors import ConfigError, LayoutUnsupported, given
from ..workload.adapters import peft_adapted

STYLE_NAMES = ("colwise", "rowwise", "sequence_parallel", "colwise_gather_output",
               "embedding_rowwise", "rowwise_split_input", "replicate",
               "replicated_with_grad_allreduce")
"""The style strings a ``TP_PLAN`` (or a Hugging Face plan) may use."""

_WAYS = ("define parallelize(model, mesh) in the model file (apply your own layout on "
         "mesh['tp']), define TP_PLAN = {'module.name.pattern': 'colwise' | 'rowwise' | "
         "'sequence_parallel' | ...} in the model file, or use a Hugging Face model whose config "
         "has a base_model_tp_plan")

_COLWISE_NAMES = ("q_proj", "k_proj", "v_proj", "query", "key", "value", "wq", "wk", "wv",
                  "gate_proj", "up_proj", "w1", "w3", "fc1", "c_fc", "fc_in", "dense_h_to_4h")
_ROWWISE_NAMES = ("o_proj", "out_proj", "wo", "down_proj", "w2", "fc2", "fc_out", "dense_4h_to_h")
_HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_heads", "n_head")
_KV_HEAD_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")


@dataclasses.dataclass(frozen=True)
class TensorParallelPlan:
    """Where the layout comes from and what it shards (module name -> style name)."""

    source: str
    """"parallelize()", "TP_PLAN", "Hugging Face tp_plan" or "derived"."""
    styles: dict = dataclasses.field(default_factory=dict)
    parallelize: object = None
    norms: tuple = ()
    """With sequence parallel (``with_sequence_parallel``): the norms that run on the rank's
    share of the sequence; empty without."""
    loss_parallel: bool = False
    """The head's logits stay split by vocabulary (a DTensor) into the loss, which runs under
    torch's ``loss_parallel`` (``tensor_parallel_step``): no rank holds the whole logits."""

    def describe(self) -> str:
        if self.parallelize is not None:
            return "the model file's parallelize(model, mesh)"
        kinds = sorted({_style_label(s) for s in self.styles.values()})
        sequence = f", sequence parallel over {len(self.norms)} norms" if self.norms else ""
        loss = ", loss parallel" if self.loss_parallel else ""
        return f"{self.source}: {len(self.styles)} modules ({', '.join(kinds)}){sequence}{loss}"


def _style_label(style) -> str:
    return style if isinstance(style, str) else type(style).__name__


def resolve_plan(model: nn.Module, namespace: dict | None, tp: int, *, source: str) -> TensorParallelPlan:
    """The TP plan of ``model`` (built from the model file whose names are ``namespace``),
    checked against ``tp``; a ``ConfigError`` naming the ways to give one when there is none."""
    namespace = namespace or {}
    if callable(namespace.get("parallelize")):
        return TensorParallelPlan("parallelize()", parallelize=namespace["parallelize"])
    if namespace.get("TP_PLAN") is not None:
        styles = _expand(model, namespace["TP_PLAN"], where=f"{source}: TP_PLAN")
        plan = TensorParallelPlan("TP_PLAN", styles)
    elif peft_adapted(model):
        plan = _adapted_plan(model, tp, source=source)
    else:
        hf_plan = _hugging_face_plan(model)
        if hf_plan:
            plan = TensorParallelPlan("Hugging Face tp_plan",
                                      _expand(model, hf_plan, where=f"{source}: the model's tp_plan"))
        else:
            plan = TensorParallelPlan("derived", _derive(model))
    if not any(_shards(style) for style in plan.styles.values()):
        raise ConfigError(f"{source}: {given('tp', tp)} needs a tensor-parallel plan and autotune "
                          f"found no projection to shard (no q/k/v/o, gate/up/down or "
                          f"Linear-activation-Linear MLP); {_WAYS}")
    check_divisible(model, plan.styles, tp, source=source)
    return plan


def _adapted_plan(model: nn.Module, tp: int, *, source: str) -> TensorParallelPlan:
    """The plan of a model peft adapts with LoRA: the base model's own (its Hugging Face tp_plan,
    else the derived one), each adapted projection split as peft's tensor-parallel LoRA splits it
    (huggingface/peft#3079): a column-wise base layer's ``lora_A`` replicated and ``lora_B``
    column-wise, so that the update comes out split as the base output does; a row-wise base
    layer's ``lora_A`` row-wise (its input is the base layer's share, its small output summed over
    the ranks) and ``lora_B`` replicated. A replicated adapter's gradient is the same on every
    tensor-parallel rank (its input's or output's gradient is made whole first), as a norm's is.
    Other adapters (DoRA's magnitude, IA3, LoHa, ...) are refused, naming the way out."""
    unsupported = sorted({_adapter_words(m) for m in model.modules() if _is_peft_layer(m) and not _is_lora_linear(m)})
    dora = any(_is_lora_linear(m) and any(bool(v) for v in getattr(m, "use_dora", {}).values())
               for m in model.modules())
    if unsupported or dora:
        what = "DoRA's magnitude vectors" if dora else ", ".join(unsupported)
        raise LayoutUnsupported(
            f"{source}: {given('tp', tp)}: autotune splits LoRA adapters on Linear layers over "
            f"tensor-parallel ranks, not {what}; define parallelize(model, mesh) in the model file "
            f"to shard the adapted model yourself, or train it without --tp (FSDP2 shards it)",
            degree="tp")
    inner_name, inner = _adapted_base(model)
    prefix = f"{inner_name}." if inner_name else ""
    hf_plan = _hugging_face_plan(inner)
    if hf_plan:
        base = {prefix + name: style for name, style in
                _expand(inner, hf_plan, where=f"{source}: the model's tp_plan").items()}
        kind = "Hugging Face tp_plan"
    else:
        base = _derive(model)
        kind = "derived"
    modules = dict(model.named_modules())
    styles = {}
    for name, style in base.items():
        module = modules[name]
        if not _is_lora_linear(module):
            if type(module).__module__.startswith("peft."):  # modules_to_save's copies, ...
                raise LayoutUnsupported(
                    f"{source}: {given('tp', tp)}: peft's {type(module).__name__} wraps {name}, which "
                    f"the plan splits; autotune splits LoRA adapters on Linear layers only: define "
                    f"parallelize(model, mesh) in the model file, or train it without --tp (FSDP2 "
                    f"shards it)", degree="tp")
            styles[name] = style
            continue
        label = _style_label(style)
        if label not in ("colwise", "rowwise"):
            raise LayoutUnsupported(
                f"{source}: {given('tp', tp)}: {name} carries LoRA adapters and its plan's style is "
                f"{label}; autotune splits adapters beside colwise and rowwise layers only: leave "
                f"{name} out of the adapters' target_modules, or define parallelize(model, mesh)",
                degree="tp")
        styles[f"{name}.base_layer"] = label
        lora_a, lora_b = ("replicate", "colwise") if label == "colwise" else ("rowwise", "replicate")
        for adapter in module.lora_A:
            styles[f"{name}.lora_A.{adapter}"] = lora_a
            styles[f"{name}.lora_B.{adapter}"] = lora_b
    return TensorParallelPlan(f"{kind}, LoRA adapters split with their layers", styles)


def _adapter_words(module: nn.Module) -> str:
    base = type(module.base_layer).__name__
    if hasattr(module, "lora_A"):
        return f"LoRA on {base} layers"
    return f"peft's {type(module).__name__} adapters on {base} layers"


def _is_peft_layer(module: nn.Module) -> bool:
    return type(module).__module__.startswith("peft.tuners.") and hasattr(module, "base_layer")


def _is_lora_linear(module: nn.Module) -> bool:
    return (_is_peft_layer(module) and isinstance(getattr(module, "lora_A", None), nn.ModuleDict)
            and isinstance(module.base_layer, nn.Linear)
            and all(isinstance(m, nn.Linear) for m in [*module.lora_A.values(), *module.lora_B.values()])
            and not getattr(module, "lora_embedding_A", None))


def _adapted_base(model: nn.Module) -> tuple[str, nn.Module]:
    """(name, module) of the model peft adapted inside ``model`` (a ``PeftModel`` holds it as
    ``base_model.model``): the outermost Hugging Face model (peft's wrappers forward its config
    and prefix as their own), else ``model``."""
    for name, module in model.named_modules():
        if type(module).__module__.startswith("transformers.") and hasattr(module, "base_model_prefix"):
            return name, module
    return "", model


def _shards(style) -> bool:
    return not (isinstance(style, str) and style in ("replicate", "replicated_with_grad_allreduce"))


def _hugging_face_plan(model: nn.Module) -> dict:
    plan = getattr(model, "tp_plan", None)
    if isinstance(plan, dict) and plan:
        return dict(plan)
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None)
    prefix = getattr(model, "base_model_prefix", "")
    if isinstance(base, dict) and base:
        inner = getattr(model, prefix, None) if prefix else None
        return {(f"{prefix}.{k}" if inner is not None and inner is not model else k): v
                for k, v in base.items()}
    return {}


def _pattern(pattern: str) -> re.Pattern:
    # "*" stands for one name part (a layer index), as in Hugging Face's and torchtitan's plans.
    return re.compile("^" + re.escape(pattern).replace(r"\*", r"[^.]+") + "$")


def _expand(model: nn.Module, plan, *, where: str) -> dict:
    """{module name: style} for every module a pattern of ``plan`` matches; every pattern must
    match at least one module and every style must be known."""
    if not isinstance(plan, dict):
        raise ConfigError(f"{where} must be a dict of module-name patterns to styles, got "
                          f"{type(plan).__name__}")
    from torch.distributed.tensor.parallel import ParallelStyle

    names = [name for name, _ in model.named_modules() if name]
    styles = {}
    for pattern, style in plan.items():
        if not isinstance(style, ParallelStyle) and style not in STYLE_NAMES:
            raise ConfigError(f"{where}: style {style!r} of {pattern!r} is not one autotune applies; "
                              f"use one of {', '.join(STYLE_NAMES)} or a torch ParallelStyle, or "
                              f"apply the layout yourself with parallelize(model, mesh) in the "
                              f"model file")
        regex = _pattern(pattern)
        matched = [name for name in names if regex.match(name)]
        if not matched:
            raise ConfigError(f"{where}: {pattern!r} matches no module of the model (its modules "
                              f"are named like {', '.join(names[:6])}, ...)")
        for name in matched:
            styles[name] = style
    return styles


def _derive(model: nn.Module) -> dict:
    """The common transformer block's plan: named projections, and Linear-activation-Linear MLPs."""
    styles = {}
    for name, module in model.named_modules():
        # A LoRA-adapted projection: its name is the projection's, its Linear the base layer.
        if not (isinstance(module, nn.Linear) or _is_lora_linear(module)) or not name:
            continue
        leaf = name.rsplit(".", 1)[-1]
        if leaf in _COLWISE_NAMES:
            styles[name] = "colwise"
        elif leaf in _ROWWISE_NAMES:
            styles[name] = "rowwise"
    for name, module in model.named_modules():
        if isinstance(module, nn.Sequential):
            prefix = f"{name}." if name else ""
            children = list(module.named_children())
            # Pairs do not overlap: a row-wise Linear's output is whole again, so a Linear after
            # it starts the next pair (a deeper MLP is colwise, rowwise, colwise, rowwise, ...).
            i = 0
            while i + 2 < len(children):
                (first, a), (_, act), (second, b) = children[i:i + 3]
                if (isinstance(a, nn.Linear) and isinstance(b, nn.Linear) and not _has_params(act)
                        and a.out_features == b.in_features
                        and prefix + first not in styles and prefix + second not in styles):
                    styles[prefix + first] = "colwise"
                    styles[prefix + second] = "rowwise"
                    i += 3
                else:
                    i += 1
    _check_pairs(model, styles)
    return styles


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _check_pairs(model: nn.Module, styles: dict) -> None:
    """A derived plan shards a block's colwise outputs and its rowwise inputs alike: within each
    parent module the rowwise projections' inputs must be the size of some colwise output (the
    q/k/v heads feed o, gate/up feed down), or the pair is left replicated."""
    modules = dict(model.named_modules())
    by_parent: dict[str, list[str]] = {}
    for name in styles:
        by_parent.setdefault(name.rsplit(".", 1)[0] if "." in name else "", []).append(name)
    for parent, names in by_parent.items():
        col = [n for n in names if styles[n] == "colwise"]
        row = [n for n in names if styles[n] == "rowwise"]
        outs = {modules[n].out_features for n in col}
        if not col or not row or any(modules[n].in_features not in outs for n in row):
            for n in names:
                styles.pop(n)


def _head_counts(module: nn.Module) -> list[tuple[str, int]]:
    """(what, count) of the attention heads a module or its config declares."""
    found = []
    config = getattr(module, "config", None)
    for attrs, what in ((_HEAD_ATTRS, "attention heads"), (_KV_HEAD_ATTRS, "KV heads")):
        for holder in (module, config):
            value = next((getattr(holder, a) for a in attrs if isinstance(getattr(holder, a, None), int)),
                         None)
            if value:
                found.append((what, value))
                break
    return found


def check_divisible(model: nn.Module, styles: dict, tp: int, *, source: str) -> None:
    """Every dimension the plan shards divisible by ``tp`` (the heads: ``Layout.check_model``)."""
    modules = dict(model.named_modules())
    for name, style in styles.items():
        module = modules[name]
        label = _style_label(style)
        dim = None
        if isinstance(module, nn.Linear):
            dim = (module.out_features if label.startswith("colwise") else
                   module.in_features if label.startswith("rowwise") else None)
        elif isinstance(module, nn.Embedding) and label in ("embedding_rowwise", "rowwise", "RowwiseParallel"):
            dim = module.num_embeddings
        if dim is not None and dim % tp:
            raise ConfigError(f"{source}: {given('tp', tp)} does not divide {name}'s sharded "
                              f"dimension {dim} ({label}); use a degree that divides {dim}")


def torch_style(style):
    """A ``ParallelStyle`` for a style name (a ParallelStyle is returned as it is; None: leave the
    module's parameters replicated, their gradients identical on every TP rank)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    if not isinstance(style, str):
        return style
    return {
        "colwise": lambda: ColwiseParallel(),
        "rowwise": lambda: RowwiseParallel(),
        "sequence_parallel": lambda: SequenceParallel(),
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
        "replicate": lambda: None,
        "replicated_with_grad_allreduce": lambda: None,
    }[style]()


_SP_STYLES = ("colwise", "rowwise", "embedding_rowwise", "colwise_gather_output", "colwise_loss_parallel")
_HEAD_STYLES = ("colwise_gather_output", "colwise_loss_parallel")


def _is_norm(module: nn.Module) -> bool:
    # torch's LayerNorm and RMSNorm, and the architectures' own (LlamaRMSNorm, T5LayerNorm, ...)
    return "Norm" in type(module).__name__ and not isinstance(module, nn.modules.batchnorm._NormBase)


def with_sequence_parallel(model: nn.Module, plan: TensorParallelPlan, tp: int, *,
                           source: str, loss_parallel: bool = False) -> TensorParallelPlan:
    """``plan`` with sequence parallel (Korthikanti et al., 2022; torchtitan's layout) where the
    model is the common decoder: one token embedding, blocks of norms and the plan's projections,
    a final norm and an untied vocabulary head, and no other parameter. Then the residual stream
    between the projections is sharded over the TP ranks by sequence (a DTensor), the norms run
    on each rank's share (``SequenceParallel``) and hand the projections the whole sequence,
    gathered once per norm; the row-wise projections reduce-scatter into the stream, the embedding
    (split by vocabulary rows) reduce-scatters into it, and the head (split by vocabulary
    columns) gathers the logits whole, or with ``loss_parallel`` hands them to the loss split by
    vocabulary (``tensor_parallel_step``). A derived plan gains the embedding and head. Otherwise
    (a model file's own TP_PLAN or parallelize, another parameter in the stream's way, tied
    embeddings) ``plan`` is returned as it is."""
    if plan.parallelize is not None or plan.source not in ("Hugging Face tp_plan", "derived"):
        return plan
    modules = dict(model.named_modules())
    styles = dict(plan.styles)
    own = [name for name, m in modules.items() if name not in styles and not _is_norm(m)
           and any(True for _ in m.parameters(recurse=False))]
    embeddings = [n for n in own if isinstance(modules[n], nn.Embedding)]
    if len(embeddings) == 1:
        styles[embeddings[0]] = "embedding_rowwise"
    embedding = [n for n, st in styles.items() if isinstance(modules[n], nn.Embedding)]
    if len(embedding) != 1 or styles[embedding[0]] not in ("embedding_rowwise", "rowwise"):
        return plan
    styles[embedding[0]] = "embedding_rowwise"  # its input: whole token ids on every rank
    vocab = modules[embedding[0]].num_embeddings
    heads = [n for n in own if isinstance(modules[n], nn.Linear) and modules[n].out_features == vocab]
    if len(heads) == 1:
        styles[heads[0]] = "colwise_gather_output"
    if any(n not in styles for n in own):
        return plan
    head = [n for n, st in styles.items() if st in _HEAD_STYLES]
    if (len(head) != 1 or modules[head[0]].weight is modules[embedding[0]].weight
            or any(st not in _SP_STYLES for st in styles.values())):
        return plan
    norms = tuple(n for n, m in modules.items() if _is_norm(m) and _has_params(m))
    if not norms:
        return plan
    styles[head[0]] = "colwise_loss_parallel" if loss_parallel else "colwise_gather_output"
    check_divisible(model, styles, tp, source=source)
    return dataclasses.replace(plan, styles=styles, norms=norms, loss_parallel=loss_parallel)


def _sequence_parallel_style(style: str):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        # The stream stays a DTensor (global shapes), so a model's own shape arithmetic holds.
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                                     use_local_output=False),
        "rowwise": lambda: RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "colwise": lambda: ColwiseParallel(),  # its input: a norm's gathered (Replicate) output
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "colwise_loss_parallel": lambda: ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }[style]()


def layout_plan(model: nn.Module, *, workload, parallel, sharding) -> TensorParallelPlan:
    """The plan its model file (``workload``) or its architecture gives ``model``
    (``resolve_plan``), checked against ``parallel.tp``, with sequence parallel where it applies
    (``with_sequence_parallel``), and loss parallel with it where the model file sets
    ``LOSS_PARALLEL = True`` (inside a pipeline too: its last stage's loss runs on the split
    logits and hands the schedule a plain scalar, ``_LossParallelLoss``). Opt-in: on gloo the real peak of a loss-parallel step
    is bimodal (a logits-sized share freed early in some runs), and the estimate is exact to the
    upper mode only (docs/parallel-layouts.md)."""
    from .sharding.settings import Sharding

    source = getattr(workload, "source", "the model")
    if not Sharding.parse(sharding).sharded:
        raise ConfigError(f"{source}: {given('tp', parallel.tp)} with ddp: tensor-parallel plans "
                          f"hold the data-parallel ranks' copies with FSDP2 (FSDP x TP, as "
                          f"torchtitan does); use {given('sharding', 'fsdp')}")
    plan = resolve_plan(model, getattr(workload, "namespace", None), parallel.tp, source=source)
    if plan.parallelize is None:
        heads = dict(_head_counts_of(model))
        parallel.check_model(heads=heads.get("attention heads"), kv_heads=heads.get("KV heads"))
    asked = _loss_parallel_asked(workload, parallel)
    plan = with_sequence_parallel(model, plan, parallel.tp, source=source, loss_parallel=asked)
    if asked and not plan.loss_parallel:
        raise ConfigError(f"{source}: LOSS_PARALLEL = True, and its tensor-parallel plan ({plan.describe()}) "
                          f"runs without sequence parallel, which loss parallel comes with: the common "
                          f"decoder (one token embedding, blocks of norms and projections, a final norm, "
                          f"an untied head, no other parameter); remove LOSS_PARALLEL from the model file")
    return plan


def _loss_parallel_asked(workload, parallel) -> bool:
    """The model file sets ``LOSS_PARALLEL = True``."""
    wanted = (getattr(workload, "namespace", None) or {}).get("LOSS_PARALLEL", False)
    if not isinstance(wanted, bool):
        raise ConfigError(f"{getattr(workload, 'source', 'the model')}: LOSS_PARALLEL = {wanted!r}; set it "
                          f"to True (the loss takes the logits split by vocabulary over the tp ranks) "
                          f"or False (gathered whole)")
    return wanted and parallel.tp > 1


def held_part(plan: TensorParallelPlan, model: nn.Module) -> TensorParallelPlan:
    """``plan`` (made on the whole model) for ``model``, a pipeline stage's copy of it: the
    modules it still holds parameters of. The cut-out embedding or head would otherwise turn the
    activations they pass into DTensors."""
    def held(name):
        try:
            return _has_params(model.get_submodule(name))
        except AttributeError:  # inside a block another stage runs
            return False

    return dataclasses.replace(plan, styles={n: st for n, st in plan.styles.items() if held(n)},
                               norms=tuple(n for n in plan.norms if held(n)))


def apply_tensor_parallel(model: nn.Module, mesh, *, workload, parallel, sharding) -> nn.Module:
    """``model`` split on ``mesh["tp"]`` (``mesh``: the whole mesh) by its ``layout_plan``."""
    return apply_plan(model, mesh, layout_plan(model, workload=workload, parallel=parallel,
                                               sharding=sharding))


class _LossParallelLoss:
    """``loss_fn(model, batch)`` of a tensor-parallel workload: its own loss, a DTensor result
    (under loss parallel, a replicated scalar) handed on as a plain tensor, which the loop's
    accumulation adds to its own totals. An error from it is annotated with the way out of loss
    parallel, where a loss does more with the split logits than cross-entropy."""

    def __init__(self, workload, tp: int):
        self.workload = workload
        self.tp = tp

    def __call__(self, model, batch):
        from torch.distributed.tensor import DTensor

        from ..memory.oom import is_oom_error

        try:
            loss, count = self.workload.loss(model, batch)
        except Exception as error:
            if not is_oom_error(error):
                error.add_note(f"autotune: with tp {self.tp} and LOSS_PARALLEL = True the decoder's logits "
                               f"reach the loss split by vocabulary (a DTensor, torch's "
                               f"loss_parallel); if this error comes from the loss using them, set "
                               f"LOSS_PARALLEL = False in {self.workload.source} to gather them whole")
            raise
        if isinstance(loss, DTensor):
            loss = loss.full_tensor()
        return loss if count is None else (loss, count)


@contextlib.contextmanager
def tensor_parallel_step(workload, parallel):
    """``workload`` for the steps of a tensor-parallel plan (``parallel``: its ``Layout``), for as
    long as this is entered (forward, backward and optimizer step). Where the model file asks for
    loss parallel (``layout_plan``), torch's ``loss_parallel`` handlers are on, so a cross-entropy
    over logits split by vocabulary runs on each rank's columns, and its loss comes back as a
    plain tensor (``_LossParallelLoss``); otherwise the workload is handed on as it is."""
    if not _loss_parallel_asked(workload, parallel):
        yield workload
        return
    with _LOSS_HANDLERS:
        yield dataclasses.replace(workload, loss_fn=_LossParallelLoss(workload, parallel.tp))


class _LossHandlers:
    """torch's ``loss_parallel`` handlers (one global switch), on while any step needs them: a
    few-block estimate's step runs inside a plan's, and the inner one must not turn them off
    under the outer. Off again even after an error: torch's context turns them off only when its
    body succeeds, and an out-of-memory trial must not leave them on."""

    def __init__(self):
        self._depth = 0
        self._context = None

    def __enter__(self):
        from torch.distributed.tensor.parallel import loss_parallel

        if self._depth == 0:
            self._context = loss_parallel()
            self._context.__enter__()
        self._depth += 1

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth == 0:
            self._context.__exit__(None, None, None)
            self._context = None
        return False


_LOSS_HANDLERS = _LossHandlers()


def _head_counts_of(model: nn.Module) -> list[tuple[str, int]]:
    found = _head_counts(model)
    for module in model.modules():
        if found:
            break
        found = _head_counts(module)
    return found


def apply_plan(model: nn.Module, mesh, plan: TensorParallelPlan) -> nn.Module:
    """Apply ``plan`` on ``mesh["tp"]`` in place (``mesh``: the whole mesh, with a "tp" dim)."""
    from torch.distributed.tensor.parallel import parallelize_module

    if plan.parallelize is not None:
        result = plan.parallelize(model, mesh)
        return model if result is None else result
    if plan.norms:
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import PrepareModuleOutput, SequenceParallel

        styles = {name: _sequence_parallel_style(style) for name, style in plan.styles.items()}
        styles.update({name: SequenceParallel() for name in plan.norms})
        parallelize_module(model, mesh["tp"], styles)
        # Each norm's output gathered once for all the projections it feeds (q, k and v; gate and
        # up), their input gradients summed before one reduce-scatter back.
        gather = {name: PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate(),
                                            use_local_output=False) for name in plan.norms}
        parallelize_module(model, mesh["tp"], gather)
        return model
    styles = {name: torch_style(style) for name, style in plan.styles.items()}
    parallelize_module(model, mesh["tp"], {name: s for name, s in styles.items() if s is not None})
    return model


def clip_grad_norm_(params, max_norm: float | None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` (``max_norm`` None: the norm alone) for parameters on
    several meshes: a tensor-parallel model's sharded DTensors next to the plain (or FSDP-only)
    parameters its plan leaves replicated, which one foreach norm cannot mix. Each group's norm
    is taken on its own, made whole (``full_tensor``) and summed; the result is a plain tensor."""
    from torch.distributed.tensor import DTensor

    params = [p for p in params if p.grad is not None]
    groups = _by_mesh(params)
    with quiet_redistribution():
        if len(groups) <= 1:
            norm = (torch.nn.utils.clip_grad_norm_(params, max_norm) if max_norm is not None
                    else torch.nn.utils.get_total_norm([p.grad for p in params]))
            return norm.full_tensor() if isinstance(norm, DTensor) else norm
        norms = []
        for group in groups.values():
            norm = torch.nn.utils.get_total_norm([p.grad for p in group])
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms))
    if max_norm is not None:
        for group in groups.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


@contextlib.contextmanager
def quiet_redistribution():
    """Without DTensor's advice, logged on every rank, that a DTensor on a 2-D mesh (FSDP x TP) is
    made whole by one collective per mesh dim and that flattening the mesh would merge them (the
    gradient norm, partial over both dims; a full state dict's gather of the 2-D shards): the
    user can do nothing about it, and the extra collective of a norm's one value, or of a
    gather done once at the end, costs nothing worth a line per rank (nor one per estimate)."""
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _by_mesh(params) -> dict:
    from torch.distributed.tensor import DTensor

    groups: dict = {}
    for p in params:
        key = (id(p.grad.device_mesh), p.grad.placements) if isinstance(p.grad, DTensor) else None
        groups.setdefault(key, []).append(p)
    return groups


def grads_by_mesh(params) -> list[list[torch.Tensor]]:
    """The gradients of ``params`` (each with one) in lists that one foreach op can take."""
    return [[p.grad for p in group] for group in _by_mesh(params).values()]


__all__ = ["STYLE_NAMES", "TensorParallelPlan", "apply_plan", "apply_tensor_parallel", "check_divisible",
           "clip_grad_norm_", "grads_by_mesh", "held_part", "layout_plan", "quiet_redistribution", "resolve_plan",
           "tensor_parallel_step", "torch_style", "with_sequence_parallel"]
