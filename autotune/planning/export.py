"""Plan -> other runners' configurations: Hugging Face, DeepSpeed, Lightning, Accelerate, torchrun,
and the cluster engines' jobs (SLURM, submitit, Kubeflow's PyTorchJob and TrainJob, Ray Train:
``clusters.py``).

Every exporter is a pure function of the plan, and each file is one the target accepts as
written (TrainingArguments(**file), DeepSpeed's config, Lightning's Trainer section, Accelerate's
launch-config loader). Runners other than autotune's own loop take one micro-batch size for every
accumulation step, so an uneven plan (43 + 43 + 42) is exported as the nearest even plan with the
same effective batch, and the export says so in its notes (``autotune plan --even`` plans the best
even split instead).
"""

from __future__ import annotations

import json
import math
import shlex
from dataclasses import dataclass, field, fields

from ..errors import ConfigError, given
from . import clusters
from ..precision import GradScalerSettings
from .lr import WARMUP_EPOCHS
from .policy import largest_divisor_at_most
from ..workload.activation_checkpointing import spread_evenly
from .types import Plan

TARGETS = ("hf", "deepspeed", "lightning", "accelerate", "torchrun", "slurm", "submitit", "kubernetes",
           "kubernetes-trainjob", "ray")
CLUSTER_TARGETS = ("torchrun", "slurm", "submitit", "kubernetes", "kubernetes-trainjob")
"""The targets that lay the plan's world out as nodes × processes per node (``nproc_per_node``)."""

TORCHRUN_STEPS = 1000
"""Optimizer steps of the torchrun export of a model file without build_dataset() (no epochs)."""


@dataclass(kw_only=True)
class EvenSplit:
    micro_batch: int
    accumulation_steps: int
    data_parallel: int
    """Ranks that take different samples: the world size over the plan's tp × cp × pp."""

    @property
    def effective_batch(self) -> int:
        return self.micro_batch * self.accumulation_steps * self.data_parallel


@dataclass(kw_only=True)
class Export:
    target: str
    config: dict | str
    """The runner's configuration (a dict), or the command line (torchrun)."""
    notes: list[str] = field(default_factory=list)
    script: dict = field(default_factory=dict)
    """Settings the file cannot hold, for the training script (Accelerator and DataLoader
    arguments); not written to the file, and repeated in the notes."""
    text: str | None = None
    """The file as written (an sbatch script, YAML manifests, a Python driver), notes included."""

    def render(self) -> str:
        """The text to write to a file: JSON for configurations, the command for torchrun, the
        job file for the cluster targets."""
        if self.text is not None:
            return self.text
        if isinstance(self.config, str):
            comments = "".join(f"# {n}\n" for n in self.notes)
            return f"{comments}{self.config}\n"
        return json.dumps(self.config, indent=2) + "\n"


def even_split(plan: Plan) -> EvenSplit:
    """The plan itself when even; otherwise the same effective batch in even micro-batches (the
    largest divisor of the per-device share that is at most the planned micro-batch)."""
    share = plan.per_device_batch
    micro = largest_divisor_at_most(share, plan.micro_batch)
    return EvenSplit(micro_batch=micro, accumulation_steps=share // micro, data_parallel=plan.data_parallel)


def _even_notes(plan: Plan, target: str) -> list[str]:
    if plan.is_even:
        return []
    even = even_split(plan)
    nearby = plan.micro_batch * plan.accumulation_steps * plan.data_parallel
    lower = (plan.micro_batch - 1) * plan.accumulation_steps * plan.data_parallel
    return [
        f"the plan is uneven ({plan.split_text} per rank) and {target} "
        f"takes one micro-batch size, so this export uses the nearest even plan with the same "
        f"effective batch: {even.micro_batch} × {even.accumulation_steps} accumulation steps × "
        f"{even.data_parallel} = {even.effective_batch}",
        f"re-plan with --even (Python: even=True) for the best even split of this target batch "
        f"(checkpointing considered), or an even target: --target-batch {lower} "
        f"({plan.micro_batch - 1} × {plan.accumulation_steps}) or {nearby} ({plan.micro_batch} × "
        f"{plan.accumulation_steps}, if it fits)" if plan.micro_batch > 1 else "",
    ]


_EXPRESSES = {"TrainingArguments": ("tp", "cp"), "Accelerate": ("tp", "cp"), "Lightning": ("tp",)}
"""The model-parallel degrees each runner's exported configuration carries (Accelerate's
``ParallelismConfig``, which TrainingArguments takes as ``parallelism_config``: tp and cp over
FSDP2; Lightning's ``ModelParallelStrategy``: tp; none has pipeline parallelism)."""


def _layout_notes(plan: Plan, target: str) -> list[str]:
    """A model-parallel plan: the per-device batch is per data-parallel rank, and what of the
    layout this runner's configuration cannot hold."""
    layout = plan.parallel
    if layout.trivial:
        return []
    described = layout.describe(plan.world_size, str(plan.sharding).upper())
    notes = [f"the plan's layout is {described}: {plan.data_parallel} data-parallel rank(s) of "
             f"{plan.world_size} take different samples, so the batch sizes here are per "
             f"data-parallel rank (tensor/context/pipeline peers share theirs)"]
    missing = [name for name in ("tp", "cp", "pp") if getattr(layout, name) > 1
               and name not in _EXPRESSES.get(target, ())]
    if missing:
        what = " × ".join(f"{name} {getattr(layout, name)}" for name in missing)
        notes.append(f"{target}'s configuration cannot express {what}: set it up in the training "
                     f"script, or train the plan with autotune's own loop (--to torchrun), which "
                     f"applies the whole layout; without it each rank holds more than planned")
    return notes


def _parallelism_sizes(plan: Plan) -> dict:
    """Accelerate's ``ParallelismConfig`` sizes for the plan (dp_replicate × dp_shard × cp × tp =
    the world without the pipeline)."""
    dp = plan.data_parallel
    group = plan.shard_group or dp if plan.sharding.sharded else 1
    return {"dp_replicate_size": dp // group, "dp_shard_size": group, "cp_size": plan.parallel.cp,
            "tp_size": plan.parallel.tp}


def _selective_notes(plan: Plan, target: str) -> list[str]:
    """A plan that checkpoints K of N blocks, for a runner that checkpoints all or none."""
    blocks, total = plan.blocks, plan.total_blocks
    if not blocks or total is None or blocks >= total:
        return []
    return [f"the plan checkpoints {blocks} of {total} repeated blocks (indices "
            f"{', '.join(map(str, spread_evenly(blocks, total)))}), and {target} checkpoints all "
            f"blocks or none: this export checkpoints all {total}, the nearest that fits (the same "
            f"memory or less, more recomputation); to keep the plan's speed, checkpoint only those "
            f"blocks in the model (autotune.workload.activation_checkpointing.enable_checkpointing("
            f"model, blocks={blocks})) or train with autotune's own loop"]


def _common_notes(plan: Plan, target: str, *, carries_warmup: bool = False,
                  carries_optimizer: bool = False) -> list[str]:
    """``carries_optimizer``: the export sets the optimizer and its LR (the plan's, else the
    optimizer's own)."""
    notes = [n for n in _even_notes(plan, target) if n] + _selective_notes(plan, target)
    notes += _layout_notes(plan, target)
    if plan.lr.lr is None and carries_optimizer and plan.workload.optimizer_lr is not None:
        notes.append(f"the model file's optimizer LR {plan.workload.optimizer_lr:g} is exported "
                     f"as it is: {plan.lr.note}")
    elif plan.lr.lr is None:
        notes.append("no learning rate is exported: " + plan.lr.note)
    elif plan.lr.warmup_steps and not carries_warmup:
        notes.append(f"warm the LR up linearly over {plan.lr.warmup_steps} optimizer steps (the "
                     f"plan's advice; {target} takes it from the script's LR scheduler)")
    elif plan.lr.scale > 1 and not plan.lr.warmup_steps:
        notes.append(f"the LR grows ×{plan.lr.scale:.4g}, so warm it up linearly over about "
                     f"{WARMUP_EPOCHS} epochs of optimizer steps ({WARMUP_EPOCHS} × dataset "
                     f"size / {plan.target_batch}); no step count is exported because the plan does "
                     f"not know the dataset size (define build_dataset() in the model file)")
    return notes


def _optimizer(plan: Plan) -> tuple[str | None, float | None, dict]:
    """The model file's optimizer (class name), the LR to train at (the plan's, else the
    optimizer's own) and its other hyperparameters as the plan recorded them."""
    lr = plan.lr.lr if plan.lr.lr is not None else plan.workload.optimizer_lr
    return plan.workload.optimizer, lr, dict(plan.workload.optimizer_settings or {})


_HF_OPTIM = {"AdamW": "adamw_torch", "Adam": "adamw_torch", "SGD": "sgd", "Adagrad": "adagrad",
             "RMSprop": "rmsprop"}
"""torch optimizers TrainingArguments(optim=...) builds (Adam: AdamW, the same without weight decay)."""
_HF_OPTIM_ARGS = {"SGD": ("momentum", "dampening", "nesterov"), "Adagrad": ("lr_decay", "eps"),
                  "RMSprop": ("momentum", "alpha", "eps", "centered")}
"""What Trainer reads from optim_args ("key=value,...") for them; weight decay is its own field
(Trainer puts it in the parameter groups, over optim_args)."""


def _hf_optimizer(plan: Plan, config: dict) -> list[str]:
    """TrainingArguments' optimizer fields for the model file's optimizer; notes for the rest."""
    name, lr, settings = _optimizer(plan)
    if name is None:
        return []
    optim = _HF_OPTIM.get(name)
    if optim is None:
        return [f"TrainingArguments cannot build the model file's {name}: pass it to "
                f"Trainer(optimizers=(optimizer, None)) with lr={lr:g}" if lr is not None else
                f"TrainingArguments cannot build the model file's {name}: pass it to "
                f"Trainer(optimizers=(optimizer, None))"]
    config["optim"] = optim
    config["weight_decay"] = settings.get("weight_decay", 0.0)
    notes = []
    if config["weight_decay"]:
        notes.append("Trainer leaves biases and LayerNorm weights out of weight decay; the model "
                     "file's optimizer decays every parameter of its groups")
    if optim == "adamw_torch":
        betas = settings.get("betas")
        if betas is not None:
            config["adam_beta1"], config["adam_beta2"] = betas
        if "eps" in settings:
            config["adam_epsilon"] = settings["eps"]
        if name == "Adam" and config["weight_decay"]:
            notes.append(f"the model file's Adam adds weight decay {config['weight_decay']:g} to the "
                         f"gradient (L2); Trainer's adamw_torch decays the weights instead (AdamW): "
                         f"for the same updates pass torch.optim.Adam to Trainer(optimizers=...)")
    else:
        args = {key: settings[key] for key in _HF_OPTIM_ARGS[name] if key in settings}
        if args:
            config["optim_args"] = ",".join(f"{key}={value}" for key, value in args.items())
    return notes


def _deepspeed_optimizer(plan: Plan) -> dict | None:
    """DeepSpeed's optimizer block for the model file's optimizer (None: none recorded). Adam and
    AdamW are DeepSpeed's own (Adam in its L2 mode, as torch's); other names DeepSpeed takes from
    torch.optim."""
    name, lr, settings = _optimizer(plan)
    if name is None:
        return None
    params = {**({"lr": lr} if lr is not None else {}), **settings}
    if name == "Adam":
        params["adam_w_mode"] = False
    return {"type": name, "params": params}


def _on_cpu(plan: Plan) -> bool:
    return plan.device is None or plan.device.kind == "cpu"


_HF_CHECKPOINTING = "activation_checkpointing"
_HF_CHECKPOINTING_OLD = "gradient_checkpointing"


def _hf_checkpointing_field() -> str | None:
    """The TrainingArguments field that switches activation checkpointing on in the installed
    transformers: ``activation_checkpointing`` (5.x, where ``gradient_checkpointing`` is a
    deprecated alias) or ``gradient_checkpointing`` (4.x); None when transformers cannot be
    imported. transformers is optional, so it is imported here and only here."""
    try:
        from transformers import TrainingArguments

        names = {f.name for f in fields(TrainingArguments)}
    except ImportError:  # not installed: the export is for another machine anyway
        return None
    return _HF_CHECKPOINTING if _HF_CHECKPOINTING in names else _HF_CHECKPOINTING_OLD


def to_hf(plan: Plan) -> Export:
    """Fields for transformers.TrainingArguments (the checkpointing switch under the name the
    installed transformers takes)."""
    _refuse_layout(plan, "hf", "TrainingArguments", ("pp",),
                   "cannot set up (its parallelism_config has no pipeline)")
    even = even_split(plan)
    checkpointing_field = _hf_checkpointing_field()
    config = {
        "per_device_train_batch_size": even.micro_batch,
        "gradient_accumulation_steps": even.accumulation_steps,
        "bf16": plan.precision == "bf16",
        "fp16": plan.precision == "fp16",
        checkpointing_field or _HF_CHECKPOINTING_OLD: plan.checkpointing.enabled,
        "max_grad_norm": plan.clip_grad_norm if plan.clip_grad_norm is not None else 0.0,
    }
    if plan.eval_micro_batch is not None:
        config["per_device_eval_batch_size"] = plan.eval_micro_batch
    if _on_cpu(plan):
        # Without it TrainingArguments refuses bf16/fp16 on a machine with no GPU.
        config["use_cpu"] = True
    if plan.compile:  # the planned peak is the compiled step's: Trainer compiles the model too
        config["torch_compile"] = True
        config["torch_compile_backend"] = plan.compile_backend or "inductor"
    _, lr, _ = _optimizer(plan)
    if lr is not None:
        config["learning_rate"] = lr
    if plan.lr.lr is not None and plan.lr.warmup_steps:
        config["warmup_steps"] = plan.lr.warmup_steps
    # autotune's loop keeps the LR constant after the warmup; Trainer's default decays it to 0.
    config["lr_scheduler_type"] = ("constant_with_warmup" if config.get("warmup_steps")
                                   else "constant")
    notes = _common_notes(plan, "TrainingArguments", carries_warmup=True, carries_optimizer=True)
    notes += _hf_optimizer(plan, config)
    if checkpointing_field is None:
        notes.append(f"transformers could not be imported here, so the checkpointing switch is "
                     f"exported as '{_HF_CHECKPOINTING_OLD}' (the name transformers 4.x takes); "
                     f"transformers 5.x deprecates it: rename it '{_HF_CHECKPOINTING}' there")
    if plan.world_size > 1:
        notes.append(f"launch on {plan.world_size} processes (e.g. torchrun --nproc_per_node "
                     f"{plan.world_size}); TrainingArguments takes the per-device batch")
    script = {}
    if plan.parallel.tp > 1 or plan.parallel.cp > 1:
        # TrainingArguments takes an accelerate.ParallelismConfig object, which JSON cannot hold.
        script["parallelism_config"] = _parallelism_sizes(plan)
        sizes = ", ".join(f"{k}={v}" for k, v in script["parallelism_config"].items())
        notes.append(f"pass TrainingArguments(..., parallelism_config=accelerate.ParallelismConfig("
                     f"{sizes})) (transformers 5, Accelerate 1.10 or later)"
                     + (" and load the model with from_pretrained(..., tp_plan=\"auto\") so its "
                        "layers split as the plan's" if plan.parallel.tp > 1 else ""))
    if plan.sharding.sharded:
        config["fsdp"] = "full_shard auto_wrap" + (" offload" if plan.sharding.offload else "")
        # Under FSDP, transformers takes checkpointing in fsdp_config (FSDP's own, per wrapped
        # layer); its training argument would add a redundant all-gather in backward, and the two
        # together are refused.
        config["fsdp_config"] = {"version": 2, "reshard_after_forward": True,
                                 "activation_checkpointing": plan.checkpointing.enabled}
        config[checkpointing_field or _HF_CHECKPOINTING_OLD] = False
        notes += _sharding_notes(plan)
    return Export(target="hf", config=config, notes=notes, script=script)


def _replicas(plan: Plan) -> int:
    """Copies of the sharded state among the data-parallel ranks (1: sharded over all of them, or
    with their context-parallel peers). Tensor, context and pipeline peers hold other parts of
    the model, not copies: a model-parallel plan over its data-parallel ranks is not hybrid."""
    group = plan.shard_group
    if not plan.sharding.sharded or group is None or group >= plan.data_parallel:
        return 1
    return plan.data_parallel // group


def _sharding_notes(plan: Plan) -> list[str]:
    notes = ["the plan shards with FSDP2 on each repeated block (transformer layer) and the root; "
             "wrap the same layers (transformer-based auto wrap) so the per-rank memory matches"]
    if _replicas(plan) > 1:
        notes.append(f"the plan is hybrid: shard within groups of {plan.shard_group} ranks and "
                     f"replicate across {_replicas(plan)} groups (HYBRID_SHARD / a 2-D device mesh)")
    return notes


def _refuse_layout(plan: Plan, target: str, runner: str, degrees: tuple[str, ...], why: str) -> None:
    """A layout with ``degrees`` the runner cannot set up: its ranks would each take a batch of
    the per-data-parallel-rank size, training a larger effective batch than planned."""
    found = [name for name in degrees if getattr(plan.parallel, name) > 1]
    if found:
        what = " × ".join(f"{name} {getattr(plan.parallel, name)}" for name in found)
        raise ConfigError(
            f"--to {target}: the plan's layout "
            f"{plan.parallel.describe(plan.world_size, str(plan.sharding).upper())} has {what}, which "
            f"{runner} {why}: its {plan.world_size} processes would each take a batch of "
            f"{plan.micro_batch}, {plan.world_size // plan.data_parallel}× the planned effective batch; "
            f"export --to torchrun (autotune's own loop applies the whole layout), or plan with "
            + " ".join(f"--{name} 1" for name in found))


def to_deepspeed(plan: Plan) -> Export:
    """A DeepSpeed config; train_batch_size = micro × accumulation × data-parallel ranks, as
    DeepSpeed checks it (its data-parallel world: the processes over its model-parallel size, so
    a model-parallel plan's config is refused unless the script sets up that layout)."""
    even = even_split(plan)
    config = {
        "train_batch_size": even.effective_batch,
        "train_micro_batch_size_per_gpu": even.micro_batch,
        "gradient_accumulation_steps": even.accumulation_steps,
        "bf16": {"enabled": plan.precision == "bf16"},
        "fp16": {"enabled": plan.precision == "fp16", "loss_scale": 0},
    }
    if plan.clip_grad_norm is not None:
        config["gradient_clipping"] = plan.clip_grad_norm
    optimizer = _deepspeed_optimizer(plan)
    if optimizer is not None:
        config["optimizer"] = optimizer
    if plan.lr.lr is not None and plan.lr.warmup_steps:
        # From 0, as autotune's loop (lr × step / warmup) and the Trainer export's
        # constant_with_warmup ramp: the same plan warms up alike in every runner.
        config["scheduler"] = {"type": "WarmupLR", "params": {
            "warmup_min_lr": 0.0, "warmup_max_lr": plan.lr.lr,
            "warmup_num_steps": plan.lr.warmup_steps, "warmup_type": "linear"}}
    if plan.sharding.sharded:
        # ZeRO stage 3 shards parameters, gradients and optimizer state, as FSDP does.
        zero = {"stage": 3}
        if plan.sharding.offload:
            zero.update(offload_param={"device": "cpu"}, offload_optimizer={"device": "cpu"})
        config["zero_optimization"] = zero
    notes = _common_notes(plan, "DeepSpeed", carries_warmup=True, carries_optimizer=True)
    if plan.precision == "fp16":
        notes += _deepspeed_loss_scale(plan.grad_scaler, config["fp16"])
    if plan.sharding.sharded:
        notes += _sharding_notes(plan)[1:]
    if plan.checkpointing:
        notes.append("the plan uses activation checkpointing: enable it in the model "
                     "(deepspeed.checkpointing or torch.utils.checkpoint); the config cannot")
    return Export(target="deepspeed", config=config, notes=notes)


def _deepspeed_loss_scale(knobs, fp16: dict) -> list[str]:
    """The GradScaler's knobs in DeepSpeed's dynamic loss scaler terms; notes for what it cannot take."""
    notes = []
    power = math.log2(knobs.init_scale)
    fp16["initial_scale_power"] = round(power)
    fp16["loss_scale_window"] = knobs.growth_interval
    if power != round(power):
        notes.append(f"DeepSpeed starts from a power of two: init_scale {knobs.init_scale:g} is "
                     f"exported as 2^{round(power)} = {2.0 ** round(power):g}")
    if (knobs.growth_factor, knobs.backoff_factor) != (2.0, 0.5):
        notes.append(f"DeepSpeed's dynamic loss scaler always grows by 2 and backs off by 0.5; the "
                     f"plan's growth_factor {knobs.growth_factor:g} and backoff_factor "
                     f"{knobs.backoff_factor:g} are not exported")
    return notes


_LIGHTNING_PRECISION = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}


def to_lightning(plan: Plan) -> Export:
    """Arguments for lightning.Trainer and the DataLoader batch size."""
    even = even_split(plan)
    trainer = {
        "accelerator": "gpu" if plan.device is not None and plan.device.kind == "cuda" else "cpu",
        "devices": plan.world_size,
        "precision": _LIGHTNING_PRECISION[plan.precision],
        "accumulate_grad_batches": even.accumulation_steps,
    }
    if plan.clip_grad_norm is not None:
        trainer.update(gradient_clip_val=plan.clip_grad_norm, gradient_clip_algorithm="norm")
    config = {"trainer": trainer, "dataloader": {"batch_size": even.micro_batch}}
    notes = _common_notes(plan, "Lightning")
    if plan.eval_micro_batch is not None:
        config["val_dataloader"] = {"batch_size": plan.eval_micro_batch}
        notes.append("val_dataloader.batch_size is the largest eval micro-batch (forward only): "
                     "give it to the DataLoader of val_dataloader()")
    _refuse_layout(plan, "lightning", "Lightning", ("cp", "pp"),
                   "cannot set up (its ModelParallelStrategy meshes data and tensor parallelism only)")
    if plan.parallel.tp > 1:
        # Lightning's 2-D strategy: its data loaders sample per data-parallel rank, and the
        # LightningModule applies FSDP2 and the tensor-parallel plan on its device mesh.
        config["model_parallel_strategy"] = {"data_parallel_size": plan.data_parallel,
                                             "tensor_parallel_size": plan.parallel.tp}
        notes.append("pass strategy=lightning.pytorch.strategies.ModelParallelStrategy("
                     "**model_parallel_strategy) to the Trainer, and in configure_model() apply "
                     "the tensor-parallel plan on self.device_mesh['tensor_parallel']"
                     + (" and fully_shard on self.device_mesh['data_parallel']"
                        if plan.sharding.sharded else "") + " (Lightning 2.4 or later)")
        if plan.sharding.sharded:
            notes += _sharding_notes(plan)
    elif plan.sharding.sharded:
        hybrid = _replicas(plan) > 1
        config["fsdp_strategy"] = {"sharding_strategy": "HYBRID_SHARD" if hybrid else "FULL_SHARD",
                                   "cpu_offload": plan.sharding.offload}
        if hybrid:
            config["fsdp_strategy"]["device_mesh"] = [_replicas(plan), plan.shard_group]
        notes.append("pass strategy=lightning.pytorch.strategies.FSDPStrategy(**fsdp_strategy, "
                     "auto_wrap_policy={YourBlock}) to the Trainer")
        notes += _sharding_notes(plan)
    if plan.checkpointing:
        notes.append("the plan uses activation checkpointing: apply it in the LightningModule "
                     "(torch.utils.checkpoint); the Trainer has no switch for it")
    return Export(target="lightning", config=config, notes=notes)


_ACCELERATE_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


def to_accelerate(plan: Plan) -> Export:
    """An Accelerate launch config (`accelerate launch --config_file FILE.json`); the Accelerator
    and DataLoader arguments, which that file cannot hold, go to ``script`` and the notes."""
    even = even_split(plan)
    cpu = _on_cpu(plan)
    if cpu and plan.sharding.sharded and plan.world_size > 1:
        raise ConfigError(
            f"--to accelerate: the plan shards with {plan.sharding} on the CPU, and Accelerate runs "
            f"FSDP only on accelerators (on the CPU its processes train unsharded replicas, each "
            f"holding what the plan shards); export --to torchrun (autotune's own loop shards on "
            f"the CPU), or plan with --sharding ddp for Accelerate")
    # Several processes on one machine: Accelerate's MULTI_CPU type starts one process unless
    # launched by mpirun, so the CPU plan takes the multi-process launcher (MULTI_GPU, torchrun
    # inside) and the script's Accelerator(cpu=True) makes the ranks one gloo group (MULTI_CPU).
    distributed = "NO" if plan.world_size == 1 else "MULTI_GPU"
    mixed = _ACCELERATE_PRECISION[plan.precision]
    config = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": distributed,
        "mixed_precision": mixed,
        "use_cpu": cpu,
        "debug": False,
        "num_processes": plan.world_size,
        "num_machines": 1,
        "machine_rank": 0,
    }
    if plan.parallel.pp > 1:
        raise ConfigError(f"--to accelerate: the plan's layout "
                          f"{plan.parallel.describe(plan.world_size, str(plan.sharding).upper())} has "
                          f"a pipeline, which Accelerate's parallelism config cannot express (its "
                          f"sizes must multiply to the {plan.world_size} processes); export --to "
                          f"torchrun (autotune's own loop runs the pipeline), or plan with --pp 1")
    if not plan.parallel.trivial and not plan.sharding.sharded:
        raise ConfigError(f"--to accelerate: Accelerate splits tensor/context parallel layouts "
                          f"over FSDP2 only, and the plan replicates ({plan.sharding}); export --to "
                          f"torchrun, or plan with --sharding fsdp")
    if plan.sharding.sharded:
        config["distributed_type"] = "FSDP"
        config["fsdp_config"] = {
            "fsdp_version": 2,
            "fsdp_reshard_after_forward": True,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_offload_params": plan.sharding.offload,
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        }
    if not plan.parallel.trivial:
        # `accelerate launch` reads parallelism_config_* keys into its ParallelismConfig.
        config["parallelism_config"] = {f"parallelism_config_{key}": value
                                        for key, value in _parallelism_sizes(plan).items()}
        if plan.parallel.cp > 1:
            config["parallelism_config"]["parallelism_config_cp_backend"] = "torch"
    accelerator = {"gradient_accumulation_steps": even.accumulation_steps, "mixed_precision": mixed}
    if cpu:
        accelerator["cpu"] = True
    notes = _common_notes(plan, "Accelerate")
    if plan.sharding.sharded:
        notes += _sharding_notes(plan)
    arguments = ", ".join(f"{key}={value!r}" for key, value in accelerator.items()
                          if key != "mixed_precision")
    notes.append(f"launch config for `accelerate launch --config_file FILE.json`; in the script use "
                 f"Accelerator({arguments}) with accelerator.accumulate(model), and "
                 f"DataLoader(..., batch_size={even.micro_batch})")
    if cpu and plan.world_size > 1:
        notes.append(f"on the CPU the file starts {plan.world_size} processes with Accelerate's "
                     f"multi-process launcher (distributed_type MULTI_GPU); Accelerator(cpu=True) "
                     f"makes them one gloo group (MULTI_CPU) that trains {even.effective_batch} "
                     f"samples per optimizer step; without it each process trains alone")
    if plan.checkpointing:
        notes.append("the plan uses activation checkpointing: apply it in the model "
                     "(torch.utils.checkpoint); Accelerate has no switch for it")
    return Export(target="accelerate", config=config, notes=notes,
                  script={"accelerator": accelerator, "dataloader": {"batch_size": even.micro_batch}})


def to_torchrun(plan: Plan, *, plan_path: str = "plan.json", model_file: str | None = None,
                nproc_per_node: int | None = None) -> Export:
    """The command that launches autotune's own loop (which takes uneven plans as they are): on
    one node (``--standalone``), or on each of world / ``nproc_per_node`` nodes with torchrun's
    c10d rendezvous at the first node."""
    # The nodes autotune's cluster exports lay out (a CUDA plan: nodes of up to 8 GPUs, as
    # --to slurm; it put a 16-GPU plan on one --standalone node of 16).
    shape = clusters.layout(plan, nproc_per_node)
    if shape.nodes > 1:
        command, notes = clusters.torchrun_multinode(plan, shape, plan_path=plan_path, model_file=model_file)
        notes = [f"run this on each of the {shape.nodes} nodes with HEAD_NODE set to the first "
                 f"node's address (and JOB_ID to the same value on every node); the checkpoint "
                 f"folder must be one every node reads (rank 0 writes it, every rank reads it on "
                 f"resume): add --resume to continue from it", *notes]
        return Export(target="torchrun", config=" ".join(_shell_word(w) for w in command), notes=notes)
    model = model_file or plan.workload.source
    command = ["torchrun", "--standalone", f"--nproc_per_node={plan.world_size}", "-m", "autotune",
               "train", model, "--plan", plan_path]
    notes = []
    if plan.workload.has_dataset is False:
        # Without a dataset there are no epochs: `autotune train` refuses to start without --steps.
        command += ["--steps", str(TORCHRUN_STEPS)]
        notes.append(f"{model} has no build_dataset(), so the run trains make_batch's batches for "
                     f"--steps optimizer steps: {TORCHRUN_STEPS} here, set it to the run you want")
    elif plan.workload.has_dataset is None:
        notes.append("add --steps N if the model file has no build_dataset() (this plan does not "
                     "say whether it has one); with a dataset it trains one epoch, or --epochs N")
    if plan.device is not None and plan.device.kind == "cpu" and plan.world_size > 1:
        notes.append("CPU processes communicate over gloo; this runs all ranks on one machine")
    if plan.sharding.sharded:
        notes.append(f"autotune train shards the model as the plan says ({plan.sharding}, shard "
                     f"group {plan.shard_group})")
    if not plan.parallel.trivial:
        notes.append(f"autotune train reads the layout from the plan and applies it: "
                     f"{plan.parallel.describe(plan.world_size, str(plan.sharding).upper())} "
                     f"(--tp {plan.parallel.tp} --cp {plan.parallel.cp} --pp {plan.parallel.pp}"
                     + (f" --pp-schedule {plan.parallel.pp_schedule} --stages-per-rank "
                        f"{plan.parallel.stages_per_rank}" if plan.parallel.pp > 1 else "")
                     + f"); {plan.data_parallel} data-parallel rank(s) take different samples")
    return Export(target="torchrun", config=shlex.join(command), notes=notes)


def _shell_word(word: str) -> str:
    """``word`` quoted for the shell, except the ${...} expansions the command relies on."""
    return f'"{word}"' if "${" in word else shlex.quote(word)


def to_slurm(plan: Plan, *, plan_path: str = "plan.json", nproc_per_node: int | None = None,
             model_file: str | None = None) -> Export:
    """An sbatch script: srun starts torchrun on every node, c10d rendezvous at the first."""
    text, notes = clusters.slurm_script(plan, plan_path=plan_path, nproc_per_node=nproc_per_node,
                                        model_file=model_file)
    shebang, rest = text.split("\n", 1)
    return Export(target="slurm", config=text, notes=notes,
                  text=shebang + "\n" + "".join(f"# {n}\n" for n in notes) + rest)


def to_submitit(plan: Plan, *, plan_path: str = "plan.json", nproc_per_node: int | None = None,
                model_file: str | None = None) -> Export:
    """A Python launcher with submitit (one SLURM task per process; autotune reads SLURM's ranks)."""
    text, notes = clusters.submitit_script(plan, plan_path=plan_path, nproc_per_node=nproc_per_node,
                                           model_file=model_file)
    return Export(target="submitit", config=text, notes=notes,
                  text="".join(f"# {n}\n" for n in notes) + text)


def to_kubernetes(plan: Plan, *, plan_path: str = "plan.json", nproc_per_node: int | None = None,
                  api: str = "pytorchjob") -> Export:
    """A checkpoint volume claim and a Kubeflow PyTorchJob (``api="trainjob"``: a Trainer v2
    TrainJob), as YAML documents for ``kubectl apply -f``."""
    build = clusters.pytorchjob if api == "pytorchjob" else clusters.trainjob
    docs, notes = build(plan, plan_path=plan_path, nproc_per_node=nproc_per_node)
    target = "kubernetes" if api == "pytorchjob" else "kubernetes-trainjob"
    return Export(target=target, config={"documents": docs}, notes=notes,
                  text=clusters.render_yaml(docs, notes))


def to_ray(plan: Plan, *, plan_path: str = "plan.json") -> Export:
    """A Ray Train driver (``autotune.integrations.ray.trainer``)."""
    text, notes = clusters.ray_script(plan, plan_path=plan_path)
    return Export(target="ray", config=text, notes=notes,
                  text="".join(f"# {n}\n" for n in notes) + text)


def export_plan(plan: Plan, target: str, *, plan_path: str = "plan.json",
                nproc_per_node: int | None = None, model_file: str | None = None) -> Export:
    """The export of ``plan`` for ``target`` (one of TARGETS). ``nproc_per_node`` lays the plan's
    world out as nodes × that many processes for the launchers (CLUSTER_TARGETS). ``model_file``:
    the model file as the launch command names it (default: the plan's ``workload.source``, which
    is relative to the folder ``autotune plan`` ran in)."""
    if nproc_per_node is not None and target not in CLUSTER_TARGETS:
        raise ConfigError(f"{given('nproc_per_node', nproc_per_node)} lays the world out in nodes "
                          f"for {', '.join(CLUSTER_TARGETS)}; --to {target} takes the world size "
                          f"({plan.world_size}) as it is: drop it")
    launchers = {
        "torchrun": lambda: to_torchrun(plan, plan_path=plan_path, nproc_per_node=nproc_per_node,
                                        model_file=model_file),
        "slurm": lambda: to_slurm(plan, plan_path=plan_path, nproc_per_node=nproc_per_node,
                                  model_file=model_file),
        "submitit": lambda: to_submitit(plan, plan_path=plan_path, nproc_per_node=nproc_per_node,
                                        model_file=model_file),
        "kubernetes": lambda: to_kubernetes(plan, plan_path=plan_path, nproc_per_node=nproc_per_node),
        "kubernetes-trainjob": lambda: to_kubernetes(plan, plan_path=plan_path,
                                                     nproc_per_node=nproc_per_node, api="trainjob"),
        "ray": lambda: to_ray(plan, plan_path=plan_path),
    }
    if target in launchers:
        return launchers[target]()  # autotune's own loop: it takes the plan's GradScaler
    exporters = {"hf": to_hf, "deepspeed": to_deepspeed, "lightning": to_lightning,
                 "accelerate": to_accelerate}
    if target not in exporters:
        raise ConfigError(f"--to {target!r} is not an export target; use one of {', '.join(TARGETS)}")
    exported = exporters[target](plan)
    if plan.seq_len is not None:
        exported.notes.append(_seq_len_note(plan, target))
    if target != "deepspeed" and plan.precision == "fp16" and plan.grad_scaler != GradScalerSettings():
        exported.notes.append(f"{target}'s configuration has no GradScaler settings: create "
                              f"torch.amp.GradScaler(**{plan.grad_scaler.to_dict()}) in code and hand "
                              f"it to the runner (autotune train uses the plan's)")
    return exported


def _seq_len_note(plan: Plan, target: str) -> str:
    """Where a runner takes the plan's sequence length: none of these configurations has a field
    for it (TrainingArguments refuses unknown keys), so the note names the places that do."""
    tokens = f" ({plan.tokens_per_step:,} tokens per optimizer step)"
    where = (f"TRL's SFTConfig(max_length={plan.seq_len}) (max_seq_length before TRL 0.20), or the "
             f"tokenizer's max_length={plan.seq_len} with truncation and padding or packing to it"
             if target == "hf" else
             f"the data pipeline: tokenize with max_length={plan.seq_len}, truncating and padding "
             f"or packing to it")
    return (f"the plan was probed at sequences of exactly {plan.seq_len} positions{tokens}: train at "
            f"that length through {where}; longer sequences would pass the planned peak")
