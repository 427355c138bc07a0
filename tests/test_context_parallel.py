"""Context parallelism: sequences sharded over the cp ranks, attention as ring attention.

Fast tests run on a fake process group (one process, fake tensors where it estimates); the real
gloo runs (gradients, peaks, training) are slow.
"""

import contextlib
import dataclasses
from pathlib import Path

import pytest
import torch

from autotune.distributed.context_parallel import check_seq_len, cpu_ring_available, shard_batch
from autotune.distributed.layout import Layout
from autotune.errors import ConfigError, WorkloadError
from autotune.workload import Workload
import cp_models

TESTS = Path(__file__).resolve().parent


@contextlib.contextmanager
def fake_ranks(world_size: int, rank: int = 0):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_sequence_length_not_divisible_by_twice_cp_names_the_limit_and_the_fix():
    with pytest.raises(ConfigError, match=r"seq_len=30 is not divisible by 2 × cp = 4.*use a sequence "
                                          r"length of 28 or 32"):
        check_seq_len(30, 2)
    check_seq_len(32, 2)
    check_seq_len(7, 1)  # no context parallelism: any length


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_holds_the_head_and_tail_chunks_of_every_sequence_tensor(rank):
    from torch.distributed.device_mesh import init_device_mesh

    batch = cp_models.make_causal_lm_batch(2, 16)
    batch["weights"] = torch.ones(2)  # no sequence dimension: left whole
    with fake_ranks(2, rank):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
        local = shard_batch(batch, mesh)
    # Chunks of 4 positions: rank 0 holds 0 and 3, rank 1 holds 1 and 2 (torch's head-tail balance).
    chunks = [rank, 3 - rank]
    expected = torch.cat([torch.arange(4 * c, 4 * c + 4) for c in chunks])
    assert torch.equal(local["positions"][0], expected)
    assert torch.equal(local["tokens"], batch["tokens"][:, expected])
    assert torch.equal(local["targets"], batch["targets"][:, expected])
    assert local["weights"] is batch["weights"]


needs_cpu_ring = pytest.mark.skipif(not cpu_ring_available(), reason=(
    f"torch {torch.__version__} has no sharding-rule hook for the CPU ring (torch 2.14 has)"))


def _workload(build, make_batch=cp_models.make_causal_lm_batch, loss_fn=cp_models.causal_lm_loss):
    return Workload(model=build, make_batch=make_batch, loss_fn=loss_fn, source=f"{build.__name__}.py")


def _estimate(workload, n, *, world_size: int, cp: int):
    """One rank's peak at micro-batch ``n`` (or {n: peak} for a list of them)."""
    from autotune.probing.estimate import estimate_peaks

    sizes = n if isinstance(n, list) else [n]
    peaks = estimate_peaks(workload, sizes, sharding="fsdp", world_size=world_size,
                           parallel=Layout(cp=cp) if cp > 1 else None)
    return peaks if isinstance(n, list) else peaks[n]


@needs_cpu_ring
def test_context_parallel_estimate_holds_a_rank_s_part_of_each_sequence(one_thread):
    workload = _workload(cp_models.build_causal_lm, lambda n: cp_models.make_causal_lm_batch(n, 64))
    fsdp = _estimate(workload, [4, 8], world_size=2, cp=1)
    cp = _estimate(workload, [4, 8], world_size=2, cp=2)
    # The same shards (FSDP2 over both ranks either way), and per sample half of every sequence's
    # activations plus the ring's key/value exchange: 0.79 of FSDP2's bytes per sample here.
    assert cp[8] < fsdp[8]
    assert (cp[8] - cp[4]) < 0.85 * (fsdp[8] - fsdp[4])


@needs_cpu_ring
@pytest.mark.slow  # Hugging Face's import and model; the accuracy tests below cover it too
def test_hugging_face_models_run_with_their_sdpa_attention_in_the_estimate(one_thread):
    workload = _workload(cp_models.build_hf_llama, cp_models.make_hf_batch, loss_fn=None)
    assert _estimate(workload, 2, world_size=2, cp=2) > 0


@needs_cpu_ring
@pytest.mark.parametrize("build, loss_fn, error, match", [
    (cp_models.build_masked_lm, cp_models.causal_lm_loss, ConfigError, "with an attention mask.*causal attention only"),
    (cp_models.build_attentionless_lm, cp_models.causal_lm_loss, ConfigError, "called no torch.nn.functional.scaled_dot_product_attention"),
    (cp_models.build_causal_lm, cp_models.causal_lm_mean_loss, WorkloadError, r"return \(loss_sum, token_count\)"),
])
def test_what_context_parallelism_cannot_shard_is_a_clear_error(one_thread, build, loss_fn, error, match):
    with pytest.raises(error, match=match):
        _estimate(_workload(build, loss_fn=loss_fn), 1, world_size=2, cp=2)


@needs_cpu_ring
def test_a_hugging_face_model_without_sdpa_names_attn_implementation(one_thread):
    workload = _workload(cp_models.build_eager_llama, cp_models.make_hf_batch, loss_fn=None)
    with pytest.raises(ConfigError, match="attention is 'eager'.*attn_implementation=\"sdpa\""):
        _estimate(workload, 1, world_size=2, cp=2)


# -- real gloo ranks (slow) -----------------------------------------------------------------------

@needs_cpu_ring
@pytest.mark.slow
@pytest.mark.parametrize("model", ["cp_hf_llama_model", "cp_hf_gpt2_model"])
def test_estimate_matches_a_real_two_rank_context_parallel_run(tmp_path, model):
    from fsdp_helpers import real_fsdp_peaks, typical_peak
    from autotune.probing.estimate import estimate_peaks

    # Not micro-batch 1: there a real step's peak moves by up to 11% from repeat to repeat (gloo's
    # threads hold or drop about 27 KiB of a 250 KiB step; the estimate is the largest, and CI's 3
    # repeats once reached only the smallest). From 2 on the peak most repeats reach is within 3%,
    # as for FSDP and TP (typical_peak): a single repeat can pass it where a gloo thread lets go of
    # a buffer late (HF Llama at 2, once the CPU backend stopped counting DTensor's propagation
    # temporaries: 327,280 bytes estimated, repeats of 327,280, 337,520 and 327,280, +3.03%).
    # Five repeats, not three: two late releases of three moved the median itself (HF Llama at 2,
    # 2026-12-05: 327,280 estimated against 337,520, 327,280 and 362,096, the median 3.03% above).
    sizes = [2, 4, 8]
    model_file = TESTS / f"{model}.py"
    estimated = estimate_peaks(model_file, sizes, sharding="fsdp", world_size=2, parallel=Layout(cp=2))
    real = real_fsdp_peaks(model_file, 2, sizes, tmp_path, cp=2, repeats=5)
    for n in sizes:
        typical = typical_peak(real[n])
        assert abs(estimated[n] - typical) <= 0.03 * typical, (n, estimated[n], real[n])


@pytest.fixture(scope="module")
def cp_runs(tmp_path_factory):
    """On 2 ranks of cp 2: the equality runs and an uninterrupted checkpointed run; then the same
    run stopped by SIGTERM to one rank, and ``autotune train --resume`` finishing it."""
    import os
    import signal
    import sys

    from autotune.planning.planfile import save_plan
    from cp_train_script import STEPS, plan
    from test_train_fsdp import TIMEOUT, _run, _start, _wait_for

    out = tmp_path_factory.mktemp("cp2")
    script = TESTS / "cp_train_script.py"
    _run(2, out, "equal", script, out, "equal", "reference")
    child, log = _start(2, out, "sigterm", script, out, "sigterm")
    try:
        _wait_for(out / "started", child, log)
        os.kill(int((out / "pid").read_text()), signal.SIGTERM)
        assert child.wait(timeout=TIMEOUT) == 0, (out / "log-sigterm.txt").read_text()[-4000:]
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
        log.close()
    plan_file = save_plan(plan(2, 2), out / "plan.json")
    _run(2, out, "resume", "--no-python", sys.executable, "-c", "from autotune.cli import main; main()",
         "train", TESTS / "cp_causal_lm_model.py", "--plan", plan_file, "--steps", STEPS,
         "--checkpoint-dir", out / "ckpt", "--resume", "--save", out / "resumed.pt")
    return out


def _saved(path):
    return torch.cat([t.reshape(-1) for t in torch.load(path, weights_only=True)["model"].values()
                      if t.is_floating_point()])


@needs_cpu_ring
@pytest.mark.slow
@pytest.mark.parametrize("name", ["causal_lm", "hf_llama", "hf_gpt2", "causal_lm_checkpointing"])
def test_context_parallel_training_ends_where_one_process_does(cp_runs, tmp_path, name):
    from autotune.training import train
    from autotune.workload.contract import load_workload
    from cp_train_script import equal_cases
    from train_helpers import relative_error

    path, planned = equal_cases(1, 1)[name]
    train(planned, load_workload(path), steps=3, progress=False, save_path=tmp_path / "one.pt")
    one, cp = _saved(tmp_path / "one.pt"), _saved(cp_runs / f"{name}-cp.pt")
    assert relative_error(cp, one) <= 1e-5
    assert relative_error(one, _saved_initial(path)) > 1e-3  # it trained


def _saved_initial(path):
    from autotune.workload.contract import load_workload

    return torch.cat([t.reshape(-1) for t in load_workload(path).new_model().state_dict().values()
                      if t.is_floating_point()])


@needs_cpu_ring
@pytest.mark.slow
def test_sigterm_then_resume_continues_a_context_parallel_run_exactly(cp_runs):
    from cp_train_script import STEPS
    from test_train_fsdp import check_resumed_as_uninterrupted

    check_resumed_as_uninterrupted(cp_runs, STEPS)


def test_plan_refuses_a_seq_len_that_cp_cannot_balance_before_probing():
    from autotune.orchestration.planner import plan

    with pytest.raises(ConfigError, match=r"seq_len=36 is not divisible by 2 × cp = 8"):
        plan(TESTS / "cp_causal_lm_model.py", target_batch=4, world_size=4, cp=4, sharding="fsdp",
             seq_len=36, memory_limit="1GiB")


def test_the_cli_names_the_seq_len_option_cp_cannot_balance():
    from click.testing import CliRunner

    from autotune.cli.main import cli

    args = ["plan", TESTS / "cp_causal_lm_model.py", "--target-batch", 4, "--world-size", 4, "--cp", 4,
            "--sharding", "fsdp", "--seq-len", 36, "--memory-limit", "1GiB"]
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code == 2, result.output  # an option's value: a usage error
    assert "--seq-len 36 is not divisible by 2 × cp = 8" in result.output
    assert "use a sequence length of 32 or 40" in result.output


@needs_cpu_ring
@pytest.mark.slow
def test_a_context_parallel_plan_is_what_verify_measures(one_thread):
    import autotune

    model_file = TESTS / "cp_causal_lm_model.py"
    plan = autotune.plan(model_file, target_batch=8, world_size=2, cp=2, sharding="fsdp",
                         precision="fp32", checkpointing="off", memory_limit="2MiB")
    assert plan.parallel.cp == 2
    result = autotune.verify_plan(plan, workload=model_file, steps=2)
    assert result.confirmed
    assert result.measured_peak_bytes == plan.predicted_peak_bytes


def test_a_torch_without_the_cpu_ring_hooks_refuses_cpu_context_parallelism_clearly(monkeypatch):
    import types

    import autotune.distributed.context_parallel as context_parallel

    monkeypatch.setattr(context_parallel, "cpu_ring_available", lambda: False)
    mesh = types.SimpleNamespace(device_type="cpu", size=lambda: 2)
    with pytest.raises(ConfigError, match="m.py: context parallelism on CPU tensors.*torch 2.14 or later"):
        with context_parallel.ring_attention(mesh, source="m.py"):
            pass


@needs_cpu_ring
def test_the_rings_composite_ops_count_the_same_bytes_as_the_fake_modes_own_path(one_thread, monkeypatch):
    # Ring attention runs below autograd, so chunk, flatten and reshape reach the counting mode
    # undecomposed; it calls their decomposition directly (memory.fake._decomposes_plainly),
    # which must count, and replay through a modelled CUDA allocator, what the fake mode's own
    # path does, to the byte.
    from autotune.memory import fake
    from autotune.memory.base import DeviceInfo
    from autotune.memory.fake import EstimateMemoryBackend
    from autotune.probing.api import window_trial

    assert fake._decomposes_plainly(torch.ops.aten.chunk.default)
    assert not fake._decomposes_plainly(torch.ops.aten.view.default)  # a meta kernel of its own
    workload = _workload(cp_models.build_causal_lm, lambda n: cp_models.make_causal_lm_batch(n, 64))
    h100 = DeviceInfo(kind="cuda", name="NVIDIA H100 80GB HBM3", budget_bytes=80 << 30)

    def measured():
        cuda = window_trial(workload, EstimateMemoryBackend(80 << 30, for_cuda=True, target=h100),
                            micro_batch=2, window=2, precision="bf16", checkpointing="on",
                            sharding="fsdp", world_size=4, parallel=Layout(cp=2))
        return _estimate(workload, [2, 4], world_size=2, cp=2), dataclasses.replace(cuda, seconds=0.0)

    fast = measured()
    monkeypatch.setattr(fake, "_decomposes_plainly", lambda func: False)
    assert measured() == fast


@needs_cpu_ring
def test_the_rings_collectives_are_counted_and_timed_under_its_steps(one_thread):
    # Per attention (2 layers, cp 2, torch's all-gather rotation): the forward all-gathers this
    # rank's keys and values from the cp ranks, the backward again (and the recompute, where
    # checkpointed), then passes the gradients on with one all-to-all per ring step. The window
    # times them, each under one ring step's attention kernel, a backward ring's last whole.
    from autotune.gpus.catalog import load_profile
    from autotune.timing.comm import call_time, network_from_profile
    from autotune.timing.count import count_steps_costs
    from autotune.timing.roofline import speed_for_profile
    from autotune.timing.window import StepModel, predict_window

    workload = _workload(cp_models.build_causal_lm, lambda n: cp_models.make_causal_lm_batch(n, 64))
    costs = count_steps_costs(workload, [2], sharding="fsdp", world_size=4, parallel=Layout(cp=2),
                              checkpointing=True)
    ring = [c for c in costs[2].collectives if c.ring]
    kv = 2 * 2 * 32 * cp_models.DIM * 4  # keys and values of 2 samples' 32 local tokens, fp32
    assert [(c.phase, c.kind, c.bytes, c.group_size) for c in ring] == [
        ("forward", "all_gather", 2 * kv, 2)] * 2 + [
        ("recompute", "all_gather", 2 * kv, 2), ("backward", "all_gather", 2 * kv, 2),
        ("backward", "all_to_all", kv, 2), ("backward", "all_to_all", kv, 2)] * 2
    profile = load_profile("h100-80gb")
    network = network_from_profile(profile)
    model = StepModel(costs, speed_for_profile(profile), "fp32")
    window = predict_window(model, [2], network=network, world_size=4, sharding="fsdp")
    without = predict_window(StepModel({2: dataclasses.replace(costs[2], collectives=tuple(
        c for c in costs[2].collectives if not c.ring))}, speed_for_profile(profile), "fp32"), [2],
        network=network, world_size=4, sharding="fsdp")
    ring_s = sum(call_time(c, network, world_size=4) for c in ring)
    assert window.comm_s == pytest.approx(without.comm_s + ring_s)
    last = call_time(ring[-1], network, world_size=4)  # each backward ring's last: exposed whole
    assert window.exposed_comm_s >= without.exposed_comm_s + 2 * last - 1e-15


@needs_cpu_ring
def test_a_model_without_sequences_is_refused_naming_cp_not_its_file():
    # An MLP's (batch, features) input: its features were split as a sequence, the first Linear
    # failed, and the error said to fix the model file (--precision, --checkpointing, --sharding).
    from autotune import plan
    from autotune.errors import LayoutUnsupported

    examples = Path(__file__).resolve().parent.parent / "examples"
    with pytest.raises(LayoutUnsupported, match=r"under context parallelism \(cp 2\) the step failed before any "
                                                r"attention ran \(RuntimeError: .*plan without --cp") as raised:
        plan(examples / "mlp.py", target_batch=64, memory_limit="64MiB", cp=2, world_size=2,
             eval_batch=False)
    assert raised.value.degree == "cp"
