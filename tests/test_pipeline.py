"""Pipeline parallelism: stages cut at the repeated blocks, the per-rank estimate on a fake process
group, and (slow, torchrun on gloo) the estimate against real peaks, training that ends where one
process ends, and SIGTERM then --resume.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from autotune.cli.main import cli
from autotune.distributed.layout import parse_layout
from autotune.distributed.pipeline import (block_container, fake_pipeline_supported, parameter_phases,
                                           rank_stage_ids, stage_bounds)
from autotune.errors import ConfigError, WorkloadError
from autotune.probing.estimate import estimate_peaks
from autotune.workload.contract import load_workload
from pp_plans import estimated_rank_peaks, real_pipeline_peaks

needs_fake_pipeline = pytest.mark.skipif(not fake_pipeline_supported(), reason=(
    f"torch {torch.__version__}'s pipeline schedules read a tensor's value in their first step "
    f"(torch 2.14's take split micro-batches and run on fake tensors)"))

TESTS = Path(__file__).resolve().parent
EXAMPLES = TESTS.parent / "examples"
TIMEOUT = 600


# -- fast: the split ---------------------------------------------------------------------------

def test_stages_split_the_blocks_evenly_and_ranks_hold_them_in_loop_order():
    assert stage_bounds(4, 2) == [(0, 2), (2, 4)]
    assert stage_bounds(7, 4) == [(0, 1), (1, 3), (3, 5), (5, 7)]
    assert rank_stage_ids(0, 2, 2) == [0, 2] and rank_stage_ids(1, 2, 2) == [1, 3]


def test_embedding_goes_with_the_first_stage_and_the_head_with_the_last():
    workload = load_workload(EXAMPLES / "tiny_lm.py")
    model = workload.new_model()
    phases = parameter_phases(model, block_container(model), workload.loss, workload.batch(1))
    assert phases == {"pos": "prefix", "embed.weight": "prefix", "ln.weight": "suffix",
                      "ln.bias": "suffix", "head.weight": "suffix"}


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_weights_tied_across_the_pipeline_are_an_error_naming_the_fix():
    model = _Tied()
    with pytest.raises(WorkloadError, match="tie_word_embeddings=False"):
        parameter_phases(model, block_container(model), lambda m, b: (m(b).sum(), None),
                         torch.zeros(1, 3, dtype=torch.long))


def test_a_model_without_repeated_blocks_is_an_error():
    with pytest.raises(WorkloadError, match="without --pp"):
        block_container(nn.Linear(3, 3))


def test_more_stages_than_blocks_is_an_error_naming_the_limit():
    with pytest.raises(ConfigError, match=r"4 repeated block\(s\).*≤ 4"):
        estimate_peaks(EXAMPLES / "tiny_lm.py", [1], accumulation_steps=5, world_size=5,
                       parallel=parse_layout(pp=5))


def test_fp16_pipelines_are_refused():
    with pytest.raises(ConfigError, match="use bf16 or fp32"):
        estimate_peaks(EXAMPLES / "mlp.py", [1], accumulation_steps=2, world_size=2, precision="fp16",
                       parallel=parse_layout(pp=2))


# -- fast: the estimate ------------------------------------------------------------------------

@needs_fake_pipeline
def test_the_estimate_is_the_worst_pipeline_rank():
    peaks = estimated_rank_peaks(EXAMPLES / "mlp.py", 4)
    parallel = parse_layout(pp=2)
    assert estimate_peaks(EXAMPLES / "mlp.py", [4], accumulation_steps=4, world_size=2,
                          parallel=parallel) == {4: max(peaks)}
    assert peaks[0] != peaks[1]  # the ranks hold different stages


BIG_HEAD = TESTS / "pp_big_head_model.py"  # its last stage holds more than its first


@needs_fake_pipeline
def test_the_probe_measures_the_worst_pipeline_rank():
    from autotune.probing.api import probe

    # 100 MiB: micro-batch 6 fits the first stage (~46 MB) and not the last (~113 MB), 5 fits both.
    result = probe(BIG_HEAD, memory_limit="100MiB", max_micro_batch=6, world_size=2,
                   parallel=parse_layout(pp=2), explain=False)
    first, last = estimated_rank_peaks(BIG_HEAD, 5, window=2)
    assert last > first
    assert result.max_micro_batch == 5 and result.peak_at(5) == last


@needs_fake_pipeline
def test_cli_estimate_takes_the_pipeline_and_its_window():
    result = CliRunner().invoke(cli, ["estimate", str(EXAMPLES / "mlp.py"), "--micro-batch", "4",
                                      "--pp", "2", "--world-size", "2"])
    assert result.exit_code == 2 and "use --accumulation-steps 2 or more" in result.output
    result = CliRunner().invoke(cli, ["estimate", str(EXAMPLES / "mlp.py"), "--micro-batch", "4",
                                      "--pp", "2", "--world-size", "2", "--accumulation-steps", "2",
                                      "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output[result.output.index("{"):]) == {
        "4": estimate_peaks(EXAMPLES / "mlp.py", [4], accumulation_steps=2, world_size=2,
                            parallel=parse_layout(pp=2))[4]}


# -- slow: real gloo ranks ---------------------------------------------------------------------

def _env(**extra):
    return dict(os.environ, OMP_NUM_THREADS="1", **extra,
                PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS), os.environ.get("PYTHONPATH", "")]))


def _torchrun(nproc, *args):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--standalone",
            *map(str, args)]


# (example, schedule, sharding, world, how far above the real peak the estimate may be). Below it
# by at most 3% everywhere. Two known gaps (bench/README.md, "pp_estimate_accuracy.py"):
# interleaved on tiny_lm is over by up to 4.3%; FSDP 2 × PP 2 on mlp depends on when gloo's worker
# thread lets go of a collective's buffer (−18% to +3.8% at n = 2) and is not held to a bound here.
ACCURACY = [("tiny_lm", "1f1b", "ddp", 2, 0.03), ("mlp", "1f1b", "ddp", 2, 0.03),
            ("mlp", "interleaved-1f1b", "ddp", 2, 0.03), ("tiny_lm", "interleaved-1f1b", "ddp", 2, 0.05),
            ("tiny_lm", "1f1b", "fsdp", 4, 0.03)]


@pytest.mark.slow
@pytest.mark.parametrize("example, schedule, sharding, world, over", ACCURACY)
def test_estimate_matches_real_gloo_pipeline_peaks(tmp_path, example, schedule, sharding, world, over):
    model_file = EXAMPLES / f"{example}.py"
    real = real_pipeline_peaks(model_file, tmp_path, pp=2, schedule=schedule, sharding=sharding,
                               world=world, window=4, sizes=[2])
    estimated = estimated_rank_peaks(model_file, 2, schedule=schedule, world_size=world, sharding=sharding)
    data_parallel = world // 2
    for pp_rank, estimate in enumerate(estimated):
        peak = max(max(real[2][pp_rank * data_parallel + d]) for d in range(data_parallel))
        assert -0.03 * peak <= estimate - peak <= over * peak, (pp_rank, estimate, peak)


@pytest.mark.slow
def test_a_pipeline_plan_states_its_worst_ranks_peak_and_gloo_reaches_it(tmp_path):
    plan_file = tmp_path / "plan.json"
    result = CliRunner().invoke(cli, ["plan", str(BIG_HEAD), "--target-batch", "8", "--memory-limit",
                                      "100MiB", "--pp", "2", "--world-size", "2", "--sharding", "fsdp",
                                      "--checkpointing", "off", "--output", str(plan_file)])
    assert result.exit_code == 0, result.output
    plan = json.loads(plan_file.read_text())
    split = plan["micro_batches"]
    assert len(set(split)) == 1  # a pipeline's window: micro-batches of one shape
    first, last = estimated_rank_peaks(BIG_HEAD, split[0], window=len(split), sharding="fsdp")
    assert plan["predicted_peak_bytes"] == last > first
    # The probe's window on real gloo ranks (the benchmark's script), then the plan trained.
    real = real_pipeline_peaks(BIG_HEAD, tmp_path, pp=2, schedule="1f1b", sharding="fsdp", world=2,
                               window=len(split), sizes=[split[0]])[split[0]]
    worst = max(max(peaks) for peaks in real)
    assert max(real[1]) == worst  # gloo's last stage is the worst rank too
    assert -0.03 * worst <= plan["predicted_peak_bytes"] - worst <= 0.03 * worst, (plan, real)
    done = subprocess.run(_torchrun(2, "-m", "autotune.cli.main", "train", BIG_HEAD, "--plan", plan_file,
                                    "--steps", "2"),
                          env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "above the plan's predicted" not in done.stdout + done.stderr


def _train(nproc, out, *args, **env):
    with open(out / f"log-{len(list(out.iterdir()))}.txt", "w") as log:
        done = subprocess.run(_torchrun(nproc, TESTS / "pp_train_script.py", out, *args), env=_env(**env),
                              stdout=log, stderr=subprocess.STDOUT, timeout=TIMEOUT)
    assert done.returncode == 0, Path(log.name).read_text()[-4000:]


def _merged(out, world):
    merged = {}
    for rank in range(world):
        merged.update(torch.load(out / f"rank-{rank}.pt")["params"])
    return merged


def _relative_error(found, reference):
    assert set(found) == set(reference)
    return max(((found[k] - reference[k]).abs().max() / reference[k].abs().max()).item() for k in reference)


def _trains_as_one_process(out, world: int, model_file, schedule: str, data_parallel: int, *, clip=None,
                           **env) -> list[dict]:
    """Train 3 steps on ``world`` gloo ranks (pp 2, FSDP2) and in one process on the same windows;
    assert they end within 1e-5 (parameters and losses). The one process's metrics."""
    from autotune.training import train
    from pp_plans import own_parameters, reference_plan, with_sgd

    _train(world, out, model_file, 2, schedule, "fsdp", 3, **env,
           **({"PP_CLIP": str(clip)} if clip is not None else {}))
    reference = train(reference_plan(data_parallel, clip=clip), with_sgd(load_workload(model_file)), steps=3,
                      seed=0, progress=False)
    assert _relative_error(_merged(out, world), own_parameters(reference.model)) < 1e-5
    losses = torch.load(out / "rank-0.pt")["losses"]
    assert losses == pytest.approx([r["loss"] for r in reference.metrics], rel=1e-5)
    return reference.metrics


@pytest.mark.slow
@pytest.mark.parametrize("example", ["tiny_lm", "mlp"])
@pytest.mark.parametrize("schedule, world", [("1f1b", 2), ("interleaved-1f1b", 2), ("zero-bubble", 2),
                                              ("1f1b", 4)])
def test_pipelined_training_ends_where_one_process_ends(tmp_path, example, schedule, world):
    _trains_as_one_process(tmp_path, world, EXAMPLES / f"{example}.py", schedule, world // 2)


@pytest.mark.slow
@pytest.mark.parametrize("world", [4, 8])
def test_tensor_parallel_inside_pipeline_stages_matches_real_peaks_and_trains_as_one_process(tmp_path, world):
    """TP 2 × PP 2 (4 ranks) and FSDP 2 × TP 2 × PP 2 (8): each pipeline rank's estimate
    against gloo's real peaks, and training against one process, the gradient norm clipped (a
    norm over every stage and both tensor-parallel shards: clipped by the same factor)."""
    model_file = EXAMPLES / "tiny_lm.py"
    estimated = estimated_rank_peaks(model_file, 2, tp=2, world_size=world, sharding="fsdp")
    real = real_pipeline_peaks(model_file, tmp_path, pp=2, tp=2, schedule="1f1b", sharding="fsdp",
                               world=world, window=4, sizes=[2])[2]
    per_stage = world // 2
    for pp_rank, estimate in enumerate(estimated):
        peak = max(max(real[pp_rank * per_stage + r]) for r in range(per_stage))
        assert abs(estimate - peak) <= 0.03 * peak, (pp_rank, estimate, peak)
    out = tmp_path / "train"
    out.mkdir()
    metrics = _trains_as_one_process(out, world, model_file, "1f1b", world // 4, clip=0.05, PP_TP="2")
    assert all(r["grad_norm"] > 0.05 for r in metrics)  # every step clipped


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_sigterm_then_resume_continues_exactly(tmp_path, tp):
    """PP 2 (2 ranks) and TP 2 × PP 2 (4)."""
    full, stopped = tmp_path / "full", tmp_path / "stopped"
    full.mkdir()
    stopped.mkdir()
    model_file = EXAMPLES / "tiny_lm.py"
    world = 2 * tp
    _train(world, full, model_file, 2, "1f1b", "fsdp", 6, full / "checkpoints", PP_TP=str(tp))
    with open(stopped / "log-sigterm.txt", "w") as log:
        child = subprocess.Popen(_torchrun(world, TESTS / "pp_train_script.py", stopped, model_file, 2, "1f1b",
                                           "fsdp", 6, stopped / "checkpoints"),
                                 env=_env(PP_SLOW="1", PP_TP=str(tp)), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + TIMEOUT
        while not (stopped / "pid-1").exists():
            assert child.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        time.sleep(3)
        os.kill(int((stopped / "pid-1").read_text()), signal.SIGTERM)
        assert child.wait(timeout=TIMEOUT) == 0
    first = torch.load(stopped / "rank-0.pt")
    assert first["interrupted"] and first["steps"] < 6
    _train(world, stopped, model_file, 2, "1f1b", "fsdp", 6, stopped / "checkpoints", "resume", PP_TP=str(tp))
    resumed = torch.load(stopped / "rank-0.pt")
    assert resumed["steps"] == 6 and not resumed["interrupted"]
    assert _relative_error(_merged(stopped, world), _merged(full, world)) == 0.0


def test_a_torch_whose_schedules_cannot_run_fake_tensors_says_so(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    import autotune.distributed.pipeline as pipeline

    monkeypatch.setattr(pipeline, "fake_pipeline_supported", lambda: False)
    with FakeTensorMode():
        batch = torch.zeros(1)
    with pytest.raises(ConfigError, match="estimated on fake tensors by torch 2.14 or later"):
        pipeline._step_micro_batches(object(), arg_mbs=[(batch,)], kwarg_mbs=[{}], target_mbs=[None],
                                     return_outputs=False)
