"""Plan -> other runners' configurations: Hugging Face, DeepSpeed, Lightning, Accelerate, torchrun.

Every exporter is a pure function of the plan. Runners other than autotune's own loop take one
micro-batch size for every accumulation step, so an uneven plan (43 + 43 + 42) is exported as the
nearest even plan with the same effective batch, and the export says so in its notes.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field, fields

from ..errors import ConfigError
from ..sharding.settings import Sharding
from .types import Plan

TARGETS = ("hf", "deepspeed", "lightning", "accelerate", "torchrun")


@dataclass(kw_only=True)
class EvenSplit:
    micro_batch: int
    accumulation_steps: int
    world_size: int

    @property
    def effective_batch(self) -> int:
        return self.micro_batch * self.accumulation_steps * self.world_size


@dataclass(kw_only=True)
class Export:
    target: str
    config: dict | str
    """The runner's configuration (a dict), or the command line (torchrun)."""
    notes: list[str] = field(default_factory=list)

    def render(self) -> str:
        """The text to write to a file: JSON for configurations, the command for torchrun."""
        if isinstance(self.config, str):
            comments = "".join(f"# {n}\n" for n in self.notes)
            return f"{comments}{self.config}\n"
        return json.dumps(self.config, indent=2) + "\n"


def even_split(plan: Plan) -> EvenSplit:
    """The plan itself when even; otherwise the same effective batch in even micro-batches (the
    largest divisor of the per-device share that is at most the planned micro-batch)."""
    share = plan.per_device_batch
    micro = next(d for d in range(plan.micro_batch, 0, -1) if share % d == 0)
    return EvenSplit(micro_batch=micro, accumulation_steps=share // micro, world_size=plan.world_size)


def _even_notes(plan: Plan, target: str) -> list[str]:
    if plan.is_even:
        return []
    even = even_split(plan)
    nearby = plan.micro_batch * plan.accumulation_steps * plan.world_size
    lower = (plan.micro_batch - 1) * plan.accumulation_steps * plan.world_size
    return [
        f"the plan is uneven ({' + '.join(map(str, plan.micro_batches))} per rank) and {target} "
        f"takes one micro-batch size, so this export uses the nearest even plan with the same "
        f"effective batch: {even.micro_batch} × {even.accumulation_steps} accumulation steps × "
        f"{even.world_size} = {even.effective_batch}",
        f"alternatively re-plan an even target: --target-batch {lower} ({plan.micro_batch - 1} × "
        f"{plan.accumulation_steps}) or {nearby} ({plan.micro_batch} × {plan.accumulation_steps}, "
        f"if it fits)" if plan.micro_batch > 1 else "",
    ]


def _common_notes(plan: Plan, target: str) -> list[str]:
    notes = [n for n in _even_notes(plan, target) if n]
    if plan.lr.lr is None:
        notes.append("no learning rate is exported: " + plan.lr.note)
    return notes


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
    even = even_split(plan)
    checkpointing_field = _hf_checkpointing_field()
    config = {
        "per_device_train_batch_size": even.micro_batch,
        "gradient_accumulation_steps": even.accumulation_steps,
        "bf16": plan.precision == "bf16",
        "fp16": plan.precision == "fp16",
        checkpointing_field or _HF_CHECKPOINTING_OLD: plan.checkpointing,
        "max_grad_norm": plan.clip_grad_norm if plan.clip_grad_norm is not None else 0.0,
        "warmup_steps": plan.lr.warmup_steps,
    }
    if plan.lr.lr is not None:
        config["learning_rate"] = plan.lr.lr
    notes = _common_notes(plan, "TrainingArguments")
    if checkpointing_field is None:
        notes.append(f"transformers could not be imported here, so the checkpointing switch is "
                     f"exported as '{_HF_CHECKPOINTING_OLD}' (the name transformers 4.x takes); "
                     f"transformers 5.x deprecates it: rename it '{_HF_CHECKPOINTING}' there")
    if plan.world_size > 1:
        notes.append(f"launch on {plan.world_size} processes (e.g. torchrun --nproc_per_node "
                     f"{plan.world_size}); TrainingArguments takes the per-device batch")
    if plan.sharding.sharded:
        config["fsdp"] = "full_shard auto_wrap" + (" offload" if plan.sharding.offload else "")
        config["fsdp_config"] = {"version": 2, "reshard_after_forward": True}
        notes += _sharding_notes(plan)
    return Export(target="hf", config=config, notes=notes)


def _sharding_notes(plan: Plan) -> list[str]:
    notes = ["the plan shards with FSDP2 on each repeated block (transformer layer) and the root; "
             "wrap the same layers (transformer-based auto wrap) so the per-rank memory matches"]
    if plan.shard_group is not None and plan.shard_group != plan.world_size:
        notes.append(f"the plan is hybrid: shard within groups of {plan.shard_group} ranks and "
                     f"replicate across {plan.world_size // plan.shard_group} groups "
                     f"(HYBRID_SHARD / a 2-D device mesh)")
    return notes


def to_deepspeed(plan: Plan) -> Export:
    """A DeepSpeed config; train_batch_size = micro × accumulation × world, as DeepSpeed checks."""
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
    if plan.sharding.sharded:
        # ZeRO stage 3 shards parameters, gradients and optimizer state, as FSDP does.
        zero = {"stage": 3}
        if plan.sharding.offload:
            zero.update(offload_param={"device": "cpu"}, offload_optimizer={"device": "cpu"})
        config["zero_optimization"] = zero
    notes = _common_notes(plan, "DeepSpeed")
    if plan.sharding.sharded:
        notes += _sharding_notes(plan)[1:]
    if plan.checkpointing:
        notes.append("the plan uses activation checkpointing: enable it in the model "
                     "(deepspeed.checkpointing or torch.utils.checkpoint); the config cannot")
    return Export(target="deepspeed", config=config, notes=notes)


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
    if plan.sharding.sharded:
        hybrid = plan.shard_group is not None and plan.shard_group != plan.world_size
        config["fsdp_strategy"] = {"sharding_strategy": "HYBRID_SHARD" if hybrid else "FULL_SHARD",
                                   "cpu_offload": plan.sharding.offload}
        if hybrid:
            config["fsdp_strategy"]["device_mesh"] = [plan.world_size // plan.shard_group,
                                                      plan.shard_group]
        notes.append("pass strategy=lightning.pytorch.strategies.FSDPStrategy(**fsdp_strategy, "
                     "auto_wrap_policy={YourBlock}) to the Trainer")
        notes += _sharding_notes(plan)
    if plan.checkpointing:
        notes.append("the plan uses activation checkpointing: apply it in the LightningModule "
                     "(torch.utils.checkpoint); the Trainer has no switch for it")
    return Export(target="lightning", config=config, notes=notes)


_ACCELERATE_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


def to_accelerate(plan: Plan) -> Export:
    """An Accelerate launch config (`accelerate launch --config_file`, JSON is accepted) and the
    Accelerator arguments (gradient accumulation is set there, not in the launch config)."""
    even = even_split(plan)
    cpu = plan.device is None or plan.device.kind == "cpu"
    if plan.world_size == 1:
        distributed = "NO"
    else:
        distributed = "MULTI_CPU" if cpu else "MULTI_GPU"
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
    if plan.sharding.sharded:
        config["distributed_type"] = "FSDP"
        config["fsdp_config"] = {
            "fsdp_version": 2,
            "fsdp_reshard_after_forward": True,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_offload_params": plan.sharding.offload,
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        }
    accelerator = {"gradient_accumulation_steps": even.accumulation_steps, "mixed_precision": mixed}
    notes = _common_notes(plan, "Accelerate")
    if plan.sharding.sharded:
        notes += _sharding_notes(plan)
    notes.append("launch config for `accelerate launch --config_file FILE.json`; pass 'accelerator' "
                 "to Accelerator(**...) and use 'dataloader.batch_size' for the DataLoader")
    return Export(target="accelerate",
                  config={"config": config, "accelerator": accelerator,
                          "dataloader": {"batch_size": even.micro_batch}},
                  notes=notes)


def to_torchrun(plan: Plan, *, plan_path: str = "plan.json", model_file: str | None = None) -> Export:
    """The command that launches autotune's own loop (which takes uneven plans as they are)."""
    model = model_file or plan.workload.source
    command = ["torchrun", "--standalone", f"--nproc_per_node={plan.world_size}", "-m", "autotune",
               "train", model, "--plan", plan_path]
    notes = []
    if plan.device is not None and plan.device.kind == "cpu" and plan.world_size > 1:
        notes.append("CPU processes communicate over gloo; this runs all ranks on one machine")
    if plan.sharding.sharded:
        notes.append(f"autotune train shards the model as the plan says ({plan.sharding}, shard "
                     f"group {plan.shard_group})")
    return Export(target="torchrun", config=shlex.join(command), notes=notes)


def export_plan(plan: Plan, target: str, *, plan_path: str = "plan.json") -> Export:
    """The export of ``plan`` for ``target`` (one of TARGETS)."""
    if target == "torchrun":
        return to_torchrun(plan, plan_path=plan_path)
    exporters = {"hf": to_hf, "deepspeed": to_deepspeed, "lightning": to_lightning,
                 "accelerate": to_accelerate}
    if target not in exporters:
        raise ConfigError(f"--to {target!r} is not an export target; use one of {', '.join(TARGETS)}")
    return exporters[target](plan)
