"""A model-parallel plan in the exports, `show` and the report: batch sizes per data-parallel rank,
the layout where a runner's configuration can hold it, a note or a refusal where not. Pure."""

import dataclasses

import pytest

from autotune import ConfigError, Layout
from autotune.cli.format import format_plan
from autotune.distributed.layout import parse_layout
from autotune.planning.export import even_split, export_plan
from autotune.planning.policy import PlanRequest, build_plan
from autotune.report.html import plan_summary

from plan_helpers import device, fingerprint, linear_probe, setting


def layout_plan(layout: Layout, *, world=8, target=64, allowed=6, sharding="fsdp", group=None):
    """A plan of ``layout`` on ``world`` ranks whose setting allows ``allowed`` per micro-step."""
    request = PlanRequest(target_batch=target, world_size=world, checkpointing="off", headroom=0.0,
                          parallel=layout, sharding=sharding)
    tried = dataclasses.replace(setting(linear_probe(allowed), headroom=0.0), sharding=sharding,
                                shard_group=(group or request.data_parallel) if sharding != "ddp" else None,
                                parallel=layout)
    planned = build_plan(request, workload=fingerprint(), settings=[tried], device=device(kind="cuda"),
                         created_at="2026-12-01T00:00:00+00:00")
    planned.reasons["layout"] = "auto: FSDP 4 × TP 2: test"
    return planned


def test_even_split_counts_data_parallel_ranks():
    planned = layout_plan(Layout(tp=2))  # 64 over 4 data-parallel ranks: 16 = 6 + 5 + 5
    assert planned.micro_batches == [6, 5, 5] and planned.data_parallel == 4
    even = even_split(planned)
    assert (even.micro_batch, even.accumulation_steps, even.data_parallel) == (4, 4, 4)
    assert even.effective_batch == 64  # not 4 × 4 × 8 = 128
    deepspeed = export_plan(planned, "deepspeed")
    assert deepspeed.config["train_batch_size"] == 64
    assert any("the nearest even plan with the same effective batch: 4 × 4 accumulation steps × 4 = 64"
               in n for n in deepspeed.notes)


@pytest.fixture(autouse=True)
def no_transformers_import(monkeypatch):
    """The HF export asks the installed transformers for its checkpointing field's name; importing
    it costs 7-25 s here, and these tests are about the layout."""
    from autotune.planning import export

    monkeypatch.setattr(export, "_hf_checkpointing_field", lambda: "gradient_checkpointing")


def test_hf_and_accelerate_carry_tensor_and_context_parallel_sizes():
    planned = layout_plan(Layout(tp=2, cp=2), world=16, target=64)  # dp 4
    accelerate = export_plan(planned, "accelerate")
    sizes = accelerate.config["parallelism_config"]
    assert sizes == {"parallelism_config_dp_replicate_size": 1, "parallelism_config_dp_shard_size": 4,
                     "parallelism_config_cp_size": 2, "parallelism_config_tp_size": 2,
                     "parallelism_config_cp_backend": "torch"}
    assert accelerate.config["distributed_type"] == "FSDP" and accelerate.config["num_processes"] == 16
    hf = export_plan(planned, "hf")
    assert hf.script["parallelism_config"] == {"dp_replicate_size": 1, "dp_shard_size": 4, "cp_size": 2,
                                               "tp_size": 2}
    assert any("parallelism_config=accelerate.ParallelismConfig(dp_replicate_size=1, dp_shard_size=4, "
               "cp_size=2, tp_size=2)" in n and 'tp_plan="auto"' in n for n in hf.notes)
    assert not any("cannot express" in n for n in hf.notes + accelerate.notes)
    hybrid = export_plan(layout_plan(Layout(tp=2), world=16, target=64, group=2), "accelerate")
    assert hybrid.config["parallelism_config"]["parallelism_config_dp_replicate_size"] == 4


@pytest.mark.slow  # importing accelerate takes 7-20 s on the loaded test machine
def test_accelerate_takes_the_exported_sizes():
    accelerate_ = pytest.importorskip("accelerate")
    hf = export_plan(layout_plan(Layout(tp=2, cp=2), world=16, target=64), "hf")
    made = accelerate_.ParallelismConfig(**hf.script["parallelism_config"])
    assert made.total_size == 16  # what Accelerate checks against the processes it starts


def test_runners_without_the_split_get_a_note_or_refuse_what_would_train_another_batch():
    # DeepSpeed checks train_batch_size against its own data-parallel world: a note. A runner
    # that would launch every process as a data-parallel rank (Lightning without cp/pp, Trainer
    # and Accelerate without pp) would train 4× the effective batch here: refused.
    piped = layout_plan(parse_layout(tp=2, pp=2))
    deepspeed = export_plan(piped, "deepspeed")
    assert deepspeed.config["train_batch_size"] == 64
    assert any("2 data-parallel rank(s) of 8 take different samples" in n for n in deepspeed.notes)
    assert any(n.startswith("DeepSpeed's configuration cannot express tp 2 × pp 2") for n in deepspeed.notes)
    for target, runner in (("lightning", "Lightning"), ("hf", "TrainingArguments")):
        with pytest.raises(ConfigError, match=rf"--to {target}: .* has pp 2, which {runner} cannot set up"
                                              rf".* 4× the planned effective batch; export --to torchrun"):
            export_plan(piped, target)
    with pytest.raises(ConfigError, match="has cp 2, which Lightning cannot set up"):
        export_plan(layout_plan(Layout(cp=2)), "lightning")
    with pytest.raises(ConfigError, match="has a pipeline, which Accelerate's parallelism config cannot"):
        export_plan(piped, "accelerate")
    with pytest.raises(ConfigError, match="over FSDP2 only, and the plan replicates"):
        export_plan(layout_plan(Layout(tp=2), sharding="ddp"), "accelerate")


def test_torchrun_keeps_its_command_and_says_the_layout_and_hosts_hold_whole_groups():
    planned = layout_plan(parse_layout(tp=2, pp=2, pp_schedule="interleaved-1f1b"))
    exported = export_plan(planned, "torchrun", plan_path="plan.json")
    assert exported.config.startswith("torchrun --standalone --nproc_per_node=8 -m autotune train")
    assert any("autotune train reads the layout from the plan and applies it: FSDP 2 × TP 2 × PP 2 "
               "(interleaved-1f1b, 2 stages per rank) (--tp 2 --cp 1 --pp 2 --pp-schedule "
               "interleaved-1f1b --stages-per-rank 2)" in n for n in exported.notes)
    assert export_plan(layout_plan(Layout(tp=4)), "slurm", nproc_per_node=4).text
    with pytest.raises(ConfigError, match="puts 4 ranks in each tensor/context-parallel group.*"
                                          "nproc_per_node=2"):
        export_plan(layout_plan(Layout(tp=4)), "slurm", nproc_per_node=2)


def test_show_and_report_carry_the_layout():
    planned = layout_plan(Layout(tp=2))
    assert ("layout:       FSDP 4 × TP 2 (4 data-parallel rank(s) of 8 take different samples; auto: "
            "FSDP 4 × TP 2: test)") in format_plan(planned)
    rows = dict(plan_summary(planned))
    assert rows["layout"] == "FSDP 4 × TP 2 on 8 rank(s): auto: FSDP 4 × TP 2: test"
    assert rows["split"].startswith("6 + 5 + 5 per rank × 4 data-parallel rank(s) = 64")


def test_a_tensor_parallel_plan_is_not_hybrid_and_lightning_gets_its_2d_strategy():
    # FSDP 4 × TP 2 shards over all 4 data-parallel ranks: no replicas (it exported as
    # HYBRID_SHARD over a [2, 4] mesh of 8 data-parallel ranks, 128 samples a step, not 64).
    planned = layout_plan(Layout(tp=2))
    assert (planned.data_parallel, planned.shard_group) == (4, 4)
    for target in ("hf", "deepspeed", "lightning", "accelerate"):
        exported = export_plan(planned, target)
        assert not any("hybrid" in n for n in exported.notes), (target, exported.notes)
    lightning = export_plan(planned, "lightning")
    assert "fsdp_strategy" not in lightning.config
    assert lightning.config["model_parallel_strategy"] == {"data_parallel_size": 4, "tensor_parallel_size": 2}
    assert lightning.config["trainer"]["devices"] == 8 and lightning.config["dataloader"]["batch_size"] == 4
    assert not any("cannot express" in n for n in lightning.notes)
    # Shard groups of 2 among 8 data-parallel ranks (16 GPUs, tp 2): 4 replicas.
    hybrid = layout_plan(Layout(tp=2), world=16, target=64, group=2)
    assert any("shard within groups of 2 ranks and replicate across 4 groups" in n
               for n in export_plan(hybrid, "hf").notes)
    plain = layout_plan(Layout(), world=8, target=64, group=2)
    flat = export_plan(plain, "lightning").config["fsdp_strategy"]
    assert flat == {"sharding_strategy": "HYBRID_SHARD", "cpu_offload": False, "device_mesh": [4, 2]}
