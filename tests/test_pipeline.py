"""Pipeline parallelism: stages cut at the repeated blocks, the per-rank estimate on a fake process
group, and (slow, torchrun on gloo) the estimate against real peaks, training that ends where one
process ends, and SIGTERM then --resume.
"""

import contextlib
import importlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from autotune.cli.main import cli
from autotune.distributed.context_parallel import cpu_ring_available
from autotune.distributed.layout import parse_layout
from autotune.distributed.pipeline import (block_container, fake_pipeline_supported, parameter_phases,
                                           rank_stage_ids, stage_bounds)
from autotune.errors import ConfigError, WorkloadError
from autotune.probing.estimate import estimate_peaks
from autotune.workload.contract import load_workload
from conftest import rank_command, rank_env, torchrun_command
from pp_plans import estimated_rank_peaks, real_pipeline_peaks

needs_fake_pipeline = pytest.mark.skipif(not fake_pipeline_supported(), reason=(
    f"torch {torch.__version__}'s pipeline schedules read a tensor's value in their first step "
    f"(torch 2.14's take split micro-batches and run on fake tensors)"))

needs_cpu_ring = pytest.mark.skipif(not cpu_ring_available(), reason=(
    f"torch {torch.__version__} has no hooks to ring the CPU's attention kernel (torch 2.14 has)"))

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


@needs_fake_pipeline
def test_a_pipeline_estimate_shows_no_warning_about_the_users_code():
    # Deep-copying the fake model for the stages' shapes made torch warn, on every pipeline
    # estimate, that accessing a FakeTensor's data pointer "is almost definitely a bug in your code".
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        estimate_peaks(EXAMPLES / "tiny_lm.py", [4], accumulation_steps=2, world_size=2,
                       parallel=parse_layout(pp=2))
    assert not [w for w in caught if "data pointer of FakeTensor" in str(w.message)]


def test_a_pipeline_trial_runs_the_rank_likeliest_to_run_out_first():
    """A trial one rank does not fit ends there: the last stage first (head and loss), then the
    first, then the middle; later trials start from the rank that peaked highest or ran out."""
    from autotune.probing.pipeline_trial import WorstPipelineRankSession
    from autotune.probing.result import Trial

    peaks = {0: 30, 2: 10, 4: 20, 6: 50}  # fake rank -> the peak of its trial
    budget = [100]
    ran, set_up = [], []

    class RankSession:
        def __init__(self, rank):
            self.rank = rank

        def __enter__(self):
            set_up.append(self.rank)
            return self

        def __exit__(self, *exc_info):
            pass

        def run(self, n, **kwargs):
            ran.append(self.rank)
            peak = peaks[self.rank] * n
            return Trial(micro_batch=n, fits=peak <= budget[0], peak_bytes=peak, seconds=0.0)

    # rank_session gives a session not entered yet; WorstPipelineRankSession enters it.
    with WorstPipelineRankSession(lambda rank: contextlib.nullcontext(RankSession(rank)),
                                  [0, 2, 4, 6]) as session:
        trial = session.run(3)  # the last stage's 150 passes the budget: no other rank runs
        assert ran == [6] and not trial.fits and trial.peak_bytes == 150
        ran.clear()
        assert session.run(2).fits and ran == [6, 0, 2, 4]  # held and worst, last, first, middle
        ran.clear()
        peaks[0] = 60  # the first stage now peaks highest: it runs first from the next trial on
        assert session.run(1).peak_bytes == 60 and ran == [6, 4, 0, 2]  # worst, held, first, middle
        ran.clear()
        budget[0] = 59
        assert not session.run(1).fits and ran == [0]
    assert set_up == [6, 0, 2, 4, 6, 4, 0, 2, 0]


def test_a_pipeline_trial_past_the_limit_it_plans_within_stops_there_not_proved_to_fit():
    """An estimate planning within a limit (a budget less its headroom, ``limited``): a rank past it
    ends the trial, which is then not proved to fit (the ranks left could hold more, past the
    budget too) and says the limit it passed; a trial whose every rank ran stays as it ran."""
    from autotune.probing.pipeline_trial import WorstPipelineRankSession
    from autotune.probing.result import Trial

    peaks = {0: 30, 2: 50}
    ran = []

    class Backend:
        limit_bytes = None

    class RankSession:
        backend = Backend()

        def __init__(self, rank):
            self.rank = rank

        def __enter__(self):
            return self

        def __exit__(self, *exc_info):
            pass

        def run(self, n, **kwargs):
            ran.append(self.rank)
            return Trial(micro_batch=n, fits=peaks[self.rank] * n <= 200, peak_bytes=peaks[self.rank] * n,
                         seconds=0.0)

    with WorstPipelineRankSession(lambda rank: contextlib.nullcontext(RankSession(rank)), [0, 2]) as session:
        assert session.run(2).fits and ran == [2, 0]  # no limit: every rank, the worst's 100
        ran.clear()
        RankSession.backend.limit_bytes = 90
        trial = session.run(2)
        assert ran == [2] and not trial.fits and trial.past_limit == 90 and trial.peak_bytes == 100
        assert trial.verdict == "past the limit"
        ran.clear()
        peaks[0] = 95  # the first rank now passes the limit, and runs last: both ran
        trial = session.run(1)
        assert ran == [2, 0] and trial.fits and trial.past_limit is None and trial.peak_bytes == 95


BIG_HEAD = TESTS / "pp_big_head_model.py"  # its last stage holds more than its first


@needs_fake_pipeline
@pytest.mark.parametrize("memo", [False, True], ids=["one-session", "fresh-builds"])
def test_a_pipeline_trial_whose_first_window_passes_the_limit_runs_no_steady_state_window(monkeypatch, memo):
    """A pipeline trial runs its schedule's first window, then the steady-state one. Where the
    first's tensors alone pass the limit the estimate plans within, the trial cannot fit (it
    peaks at least there): it ends, past the limit, without the second window. Also where each
    trial runs on a fresh build (a --gpu planner's CUDA target, whose memo keeps the answers)."""
    from autotune.distributed.pipeline import PipelinedModel
    from autotune.memory.fake import EstimateMemoryBackend
    from autotune.probing.api import window_trial

    windows = []
    real_run = PipelinedModel.run

    def run(self, batches, weigh, loss):
        windows.append(len(batches))
        return real_run(self, batches, weigh, loss)

    monkeypatch.setattr(PipelinedModel, "run", run)

    def trial(limit):
        windows.clear()
        backend = EstimateMemoryBackend(2**30, for_cuda=memo)  # a CUDA target's trials run fresh
        backend.trials_memo = {} if memo else None
        return window_trial(BIG_HEAD, backend, micro_batch=4, window=2, precision="fp32",
                            checkpointing="off", sharding="fsdp", world_size=2, parallel=parse_layout(pp=2),
                            reduce_every_micro_step=True, limit=limit)

    whole = trial(None)
    assert whole.fits and whole.past_limit is None and len(windows) == 4  # two windows on each rank
    limit = whole.peak_bytes // 2
    stopped = trial(limit)
    # The likeliest rank (the last stage: the big head) ran its first window alone.
    assert not stopped.fits and stopped.past_limit == limit and stopped.peak_bytes > limit
    assert windows == [2]
    assert stopped.verdict == "past the limit"


@pytest.mark.slow
@needs_fake_pipeline
def test_the_probe_measures_the_worst_pipeline_rank():
    from autotune.probing.api import probe

    # 100 MiB: micro-batch 6 fits the first stage (~46 MB) and not the last (~113 MB), 5 fits both.
    result = probe(BIG_HEAD, memory_limit="100MiB", max_micro_batch=6, world_size=2,
                   parallel=parse_layout(pp=2), explain=False)
    first, last = estimated_rank_peaks(BIG_HEAD, 5, window=2)
    assert last > first
    assert result.max_micro_batch == 5 and result.peak_at(5) == last


@pytest.mark.slow
@needs_fake_pipeline
def test_the_pipeline_ranks_count_the_models_step_once_per_micro_step():
    """Step costs of PP 2 (--optimize throughput): each pipeline rank's micro-step, counted over
    the schedule's window and divided per micro-step. Its stages' matmul FLOPs add up to the
    whole model's one step (forward and backward; the blocks split between them) to the FLOP,
    each rank's optimizer phase is its own parameters', and the slowest rank is what the step
    model takes."""
    from autotune.timing.count import count_steps_costs, pipeline_rank_costs

    workload = EXAMPLES / "tiny_lm.py"
    whole = count_steps_costs(workload, [2, 3])
    layout = parse_layout(pp=2)
    ranks = pipeline_rank_costs(workload, [2, 3], world_size=2, parallel=layout)
    slowest = count_steps_costs(workload, [2, 3], sharding="fsdp", world_size=2, parallel=layout)
    for n in (2, 3):
        flops = [c.flops_by("phase") for c in (whole[n], *(r[n] for r in ranks))]
        for phase in ("forward", "backward"):
            assert flops[1][phase] + flops[2][phase] == pytest.approx(flops[0][phase], rel=1e-12)
            assert 0 < flops[1][phase] < flops[0][phase]
        optimizer = [c.bytes_by("phase")["optimizer"] for c in (whole[n], *(r[n] for r in ranks))]
        assert optimizer[1] + optimizer[2] == pytest.approx(optimizer[0], rel=0.05)
        assert slowest[n].total_flops == max(r[n].total_flops for r in ranks)
        # Each micro-step's activations cross once each way between the stages.
        sends = [c for r in ranks for c in r[n].collectives if c.kind == "send"]
        assert sends and all(c.bytes == sends[0].bytes for c in sends), sends


def test_a_stage_copied_on_fake_tensors_keeps_its_weights_views_on_their_storage():
    """A rank with several stages copies the model for each but its last. A deep-copied
    FakeTensor's views report another storage than the tensor, so the estimate counted the
    ``weight.t()`` a linear saves for backward as a second weight: interleaved 1F1B on tiny_lm was
    one block's weights (+2.2% to +4.3%) over gloo's real peak."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autotune.distributed.pipeline import _copy_model

    with FakeTensorMode():
        model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8), nn.Linear(8, 16, bias=False))
        model[2].weight = model[0].weight  # tied
        model.register_buffer("scale", torch.ones(8))
        copied = _copy_model(model)
        for name, p in copied.named_parameters():
            assert p.t().untyped_storage()._cdata == p.untyped_storage()._cdata, name
            assert p is not dict(model.named_parameters())[name] and p.requires_grad
        assert copied[2].weight is copied[0].weight and isinstance(copied[1].weight, nn.Parameter)
        assert copied.scale is not model.scale and copied.scale.shape == (8,)
    real = nn.Linear(2, 2)
    twin = _copy_model(real)
    assert torch.equal(twin.weight, real.weight) and twin.weight is not real.weight


@needs_fake_pipeline
def test_a_pipelines_shape_inference_counts_nothing_in_its_estimate(monkeypatch):
    """A new schedule learns each stage's output shape from a no-grad forward of the whole model
    on fake tensors, which a real run does in a fake mode of its own (allocating nothing). The
    estimate ran it in its counting mode, in the first window its trial now measures: every
    rank's peak held the whole model's logits (9.9 GiB on each of Llama 8B's 8 pipeline ranks
    at sequence 8192, where a middle stage of 4 checkpointed blocks holds 2.2)."""
    from autotune.memory.fake import _CountingFakeTensorMode

    n = 5
    first, last = estimated_rank_peaks(BIG_HEAD, n, window=2)
    monkeypatch.setattr(_CountingFakeTensorMode, "uncounted", lambda self: contextlib.nullcontext())
    counted_first, counted_last = estimated_rank_peaks(BIG_HEAD, n, window=2)
    # The whole model's logits (tiny_lm's sequence, this model's vocabulary, fp32: 21 MB) came
    # on top of what the first stage held at that moment: 59.5 MB against 41.7 MB measured.
    logits = n * 128 * 8192 * 4
    assert counted_first - first > logits / 2, (counted_first, first)
    assert counted_last >= last


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

# (example, schedule, sharding, world, how far above the real peak the estimate may be). Below it
# by at most 3% everywhere. A known gap (bench/README.md, "pp_estimate_accuracy.py"): FSDP 2 × PP 2
# on mlp depends on when gloo's worker thread lets go of a collective's buffer (−18% to +3.8% at
# n = 2) and is not held to a bound here. Interleaved on tiny_lm was over by up to 4.3% until the
# copied stages' fake weights were cloned by an op (``pipeline._copy_model``): now to 12 bytes.
ACCURACY = [("tiny_lm", "1f1b", "ddp", 2, 0.03), ("mlp", "1f1b", "ddp", 2, 0.03),
            ("mlp", "interleaved-1f1b", "ddp", 2, 0.03), ("tiny_lm", "interleaved-1f1b", "ddp", 2, 0.03),
            ("pp_hf_llama4_model", "interleaved-1f1b", "ddp", 2, 0.03), ("tiny_lm", "1f1b", "fsdp", 4, 0.03)]


@pytest.mark.slow
@pytest.mark.parametrize("example, schedule, sharding, world, over", ACCURACY)
def test_estimate_matches_real_gloo_pipeline_peaks(tmp_path, example, schedule, sharding, world, over):
    model_file = next(path for path in (EXAMPLES / f"{example}.py", TESTS / f"{example}.py") if path.exists())
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
    done = subprocess.run(torchrun_command(2, "-m", "autotune.cli.main", "train", BIG_HEAD, "--plan", plan_file,
                                    "--steps", "2"),
                          env=rank_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "above the plan's predicted" not in done.stdout + done.stderr


def _train(nproc, out, *args, **env):
    with open(out / f"log-{len(list(out.iterdir()))}.txt", "w") as log:
        done = subprocess.run(rank_command(nproc, TESTS / "pp_train_script.py", out, *args), env=rank_env(**env),
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
@pytest.mark.parametrize("model_file, world", [(EXAMPLES / "tiny_lm.py", 4), (EXAMPLES / "tiny_lm.py", 8),
                                               (TESTS / "cp_hf_llama_model.py", 4),
                                               (EXAMPLES / "real" / "llama_lora.py", 4)],
                         ids=["tiny_lm-4", "tiny_lm-8", "hf_llama-4", "hf_llama_lora-4"])
def test_tensor_parallel_inside_pipeline_stages_matches_real_peaks_and_trains_as_one_process(
        tmp_path, monkeypatch, model_file, world):
    """TP 2 × PP 2 (4 ranks) and FSDP 2 × TP 2 × PP 2 (8): each pipeline rank's estimate
    against gloo's real peaks, and training against one process, the gradient norm clipped (a
    norm over every stage and both tensor-parallel shards: clipped by the same factor). HF
    Llama brings its own tp_plan, whose embedding and head each stage but one has cut out, and
    runs with sequence parallel: stages send and receive their share of the sequence; its LoRA
    version (peft, the base frozen) splits each adapter with the layer it adapts in every stage
    and trains only the adapters, as one process does. As in
    test_tensor_parallel: the estimate holds each all-gather's buffers until the next
    collective, as a late gloo worker thread does in some repeats (sequence parallel gathers
    at every norm), so it is at least what most repeats reach; without that it is at most 3%
    above the largest real peak."""
    from autotune.memory.fake import _GlooCollectiveBuffers
    from fsdp_helpers import typical_peak, worst_peak

    estimated = estimated_rank_peaks(model_file, 2, tp=2, world_size=world, sharding="fsdp")
    with monkeypatch.context() as patch:
        patch.setattr(_GlooCollectiveBuffers, "released_late", False)
        prompt = estimated_rank_peaks(model_file, 2, tp=2, world_size=world, sharding="fsdp")
    real = real_pipeline_peaks(model_file, tmp_path, pp=2, tp=2, schedule="1f1b", sharding="fsdp",
                               world=world, window=4, sizes=[2])[2]
    per_stage = world // 2
    for pp_rank, (estimate, early) in enumerate(zip(estimated, prompt)):
        ranks = real[pp_rank * per_stage:(pp_rank + 1) * per_stage]
        assert estimate >= typical_peak(ranks) / 1.03, (pp_rank, estimate, ranks)
        assert early <= worst_peak(ranks) * 1.03 and estimate >= early, (pp_rank, early, ranks)
    out = tmp_path / "train"
    out.mkdir()
    metrics = _trains_as_one_process(out, world, model_file, "1f1b", world // 4, clip=0.05, PP_TP="2")
    assert all(r["grad_norm"] > 0.05 for r in metrics)  # every step clipped


@pytest.mark.slow
def test_loss_parallel_inside_pipeline_stages_matches_real_peaks_and_trains_as_one_process(tmp_path):
    """TP 2 × PP 2 on 4 gloo ranks with LOSS_PARALLEL = True (examples/real/llama.py): the last
    stage's loss takes the logits split by vocabulary and hands the schedule a plain scalar. Its
    real peaks are bimodal as outside pipelines (docs/parallel-layouts.md): the estimate is the
    upper mode, at least what most repeats reach less 3% and at most 3% above the largest."""
    from fsdp_helpers import typical_peak, worst_peak

    model_file = TESTS / "hf_llama_lp_model.py"
    estimated = estimated_rank_peaks(model_file, 2, schedule="1f1b", world_size=4, sharding="fsdp", tp=2)
    real = real_pipeline_peaks(model_file, tmp_path, pp=2, tp=2, schedule="1f1b", sharding="fsdp",
                               world=4, window=4, sizes=[2])[2]
    for pp_rank, estimate in enumerate(estimated):
        ranks = real[2 * pp_rank:2 * pp_rank + 2]
        assert typical_peak(ranks) / 1.03 <= estimate <= worst_peak(ranks) * 1.03, (pp_rank, estimate, ranks)
    out = tmp_path / "train"
    out.mkdir()
    metrics = _trains_as_one_process(out, 4, model_file, "1f1b", 1, clip=0.05, PP_TP="2")
    assert all(r["grad_norm"] > 0.05 for r in metrics)


@needs_cpu_ring
@pytest.mark.slow
@pytest.mark.parametrize("model_file, schedule, clip", [
    (EXAMPLES / "real" / "llama.py", "1f1b", 0.05), (TESTS / "cp_causal_lm_model.py", "1f1b", None),
    (TESTS / "pp_hf_llama4_model.py", "interleaved-1f1b", None)], ids=["llama", "causal_lm", "llama4-interleaved"])
def test_context_parallel_inside_pipeline_stages_matches_real_peaks_and_trains_as_one_process(
        tmp_path, model_file, schedule, clip):
    """CP 2 × PP 2 on 4 gloo ranks: each stage's loss shards every micro-batch's sequence over
    its cp ranks and rings attention, the stages send their cp rank's share, and FSDP2 reduces
    the gradients over the cp ranks. Each pipeline rank's estimate within 3% of the peak most
    repeats reach (a gloo worker thread lets go of a ring's buffers late in some), and training
    (items weighed across micro-batches and cp ranks; HF Llama clipped every step) within 1e-5 of
    one process on whole sequences."""
    from fsdp_helpers import typical_peak

    estimated = estimated_rank_peaks(model_file, 2, schedule=schedule, cp=2, world_size=4, sharding="fsdp")
    real = real_pipeline_peaks(model_file, tmp_path, pp=2, cp=2, schedule=schedule, sharding="fsdp",
                               world=4, window=4, sizes=[2])[2]
    for pp_rank, estimate in enumerate(estimated):
        typical = typical_peak(real[2 * pp_rank:2 * pp_rank + 2])
        assert abs(estimate - typical) <= 0.03 * typical, (pp_rank, estimate, real)
    out = tmp_path / "train"
    out.mkdir()
    metrics = _trains_as_one_process(out, 4, model_file, schedule, 1, clip=clip, PP_CP="2")
    if clip is not None:
        assert all(r["grad_norm"] > clip for r in metrics)


@pytest.mark.slow
def test_a_loss_that_counts_its_items_trains_every_stage_as_one_process(tmp_path):
    """A (loss_sum, item_count) loss: only the last stage counts items, and every stage's
    gradients take the window's sum / count correction. Before, the other stages skipped the
    totals' all-reduce the last stage ran, and the run hung in its first optimizer step."""
    _trains_as_one_process(tmp_path, 2, TESTS / "sp_decoder_model.py", "1f1b", 1)


@pytest.mark.slow
@pytest.mark.parametrize("model, degree, budget, target", [("sp_decoder_model", "--tp", "200KiB", "8"),
                                                           ("sp_decoder_lp_model", "--tp", "200KiB", "8"),
                                                           ("cp_causal_lm_model", "--cp", "600KiB", "16")])
def test_autotune_train_runs_a_sequence_split_pipeline_plan_within_its_peak(tmp_path, model, degree, budget,
                                                                            target):
    """TP 2 (sequence parallel, with and without loss parallel) × PP 2 and CP 2 × PP 2 on 4 gloo
    ranks, through the CLI as a user runs it: the first step within 3% of the plan's peak (plus
    one activation gloo may hold late), the later ones below it. The first step peaks highest (the window that builds the
    stages): 13% above the plan before the probe counted that window too, inside the budget's
    10% headroom, so no warning said so."""
    if degree == "--cp" and not cpu_ring_available():
        pytest.skip(f"torch {torch.__version__} has no hooks to ring the CPU's attention kernel")
    plan_file = tmp_path / "plan.json"
    model_file = TESTS / f"{model}.py"
    result = CliRunner().invoke(cli, ["plan", str(model_file), "--target-batch", target, "--world-size", "4",
                                      degree, "2", "--pp", "2", "--sharding", "fsdp", "--memory-limit", budget,
                                      "--precision", "fp32", "--checkpointing", "off", "--output", str(plan_file)])
    assert result.exit_code == 0, result.output
    plan = json.loads(plan_file.read_text())
    assert len(plan["micro_batches"]) >= 2 and plan["parallel"][degree[2:]] == plan["parallel"]["pp"] == 2
    done = subprocess.run(torchrun_command(4, "-m", "autotune.cli.main", "train", model_file, "--plan", plan_file,
                                    "--steps", "3"),
                          env=rank_env(), capture_output=True, text=True, timeout=TIMEOUT, cwd=tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "above the plan's predicted" not in output
    peaks = [float(line.split(" peak ")[1].split(" KiB")[0]) * 1024
             for line in output.splitlines() if line.startswith("step ")]
    assert len(peaks) == 3, output[-3000:]
    predicted = plan["predicted_peak_bytes"]
    # One full-sequence activation (micro-batch × sequence × dim, fp32): CI once measured the
    # first step 2 KiB higher than the 140.16 KiB this machine measures every time (+3.3%), one
    # gathered activation that gloo's worker thread held past the next collective.
    constants = importlib.import_module("sp_decoder_model" if degree == "--tp" else "cp_models")
    gathered = plan["micro_batches"][0] * constants.SEQ_LEN * constants.DIM * 4
    assert predicted * 0.97 <= peaks[0] <= predicted * 1.03 + gathered, (peaks, predicted)
    assert max(peaks) == peaks[0]


@pytest.mark.slow
@pytest.mark.parametrize("tp, cp", [(1, 1), (2, 1), (1, 2)])
def test_sigterm_then_resume_continues_exactly(tmp_path, tp, cp):
    """PP 2 (2 ranks), TP 2 × PP 2 and CP 2 × PP 2 (4)."""
    if cp > 1 and not cpu_ring_available():
        pytest.skip(f"torch {torch.__version__} has no hooks to ring the CPU's attention kernel")
    full, stopped = tmp_path / "full", tmp_path / "stopped"
    full.mkdir()
    stopped.mkdir()
    model_file = EXAMPLES / "tiny_lm.py" if cp == 1 else TESTS / "cp_causal_lm_model.py"
    world = 2 * tp * cp
    degrees = dict(PP_TP=str(tp), PP_CP=str(cp))
    _train(world, full, model_file, 2, "1f1b", "fsdp", 6, full / "checkpoints", **degrees)
    with open(stopped / "log-sigterm.txt", "w") as log:
        child = subprocess.Popen(rank_command(world, TESTS / "pp_train_script.py", stopped, model_file, 2, "1f1b",
                                           "fsdp", 6, stopped / "checkpoints"),
                                 env=rank_env(PP_SLOW="1", **degrees), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + TIMEOUT
        while not (stopped / "pid-1").exists():
            assert child.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        time.sleep(3)
        os.kill(int((stopped / "pid-1").read_text()), signal.SIGTERM)
        assert child.wait(timeout=TIMEOUT) == 0
    first = torch.load(stopped / "rank-0.pt")
    assert first["interrupted"] and first["steps"] < 6
    _train(world, stopped, model_file, 2, "1f1b", "fsdp", 6, stopped / "checkpoints", "resume", **degrees)
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


def test_a_sequence_parallel_stage_sends_its_share_and_refuses_a_sequence_tp_does_not_divide():
    from types import SimpleNamespace

    from autotune.distributed.pipeline import PipelinedModel

    split = SimpleNamespace(split_sequence=(1, 2))
    assert PipelinedModel._share(split, (3, 8, 16), torch.float32) == ((3, 4, 16), torch.float32)
    assert PipelinedModel._share(SimpleNamespace(split_sequence=(1, 1)), (3, 7, 16), None) == ((3, 7, 16), None)
    with pytest.raises(ConfigError, match=r"shape \[3, 7, 16\] cannot be split by sequence .* over tp 2"):
        PipelinedModel._share(split, (3, 7, 16), torch.float32)


def test_a_context_parallel_stage_sends_its_share_of_both_splits_and_names_the_length_they_need():
    from types import SimpleNamespace

    from autotune.distributed.pipeline import PipelinedModel

    cp = SimpleNamespace(split_sequence=(2, 1))
    assert PipelinedModel._share(cp, (3, 8, 16), torch.float32) == ((3, 4, 16), torch.float32)
    both = SimpleNamespace(split_sequence=(2, 2))
    assert PipelinedModel._share(both, (3, 16, 16), torch.float32) == ((3, 4, 16), torch.float32)
    # 6 splits into cp 2's halves but not into its 2 × cp = 4 load-balanced chunks.
    with pytest.raises(ConfigError, match=r"over cp 2 ranks: this pipeline needs a sequence length divisible by 4"):
        PipelinedModel._share(cp, (3, 6, 16), torch.float32)
    with pytest.raises(ConfigError, match=r"over cp 2 × tp 4 ranks: .* divisible by 8"):
        PipelinedModel._share(SimpleNamespace(split_sequence=(2, 4)), (3, 12, 16), torch.float32)


@needs_fake_pipeline
@pytest.mark.slow  # a plan and a real window of each pipeline rank: about 20 s
@pytest.mark.parametrize("model_file, layout, budget, world", [
    (EXAMPLES / "tiny_lm.py", dict(pp=2), "40MiB", 2),
    (TESTS / "cp_causal_lm_model.py", dict(pp=2, cp=2), "600KiB", 4)], ids=["pp2", "cp2-pp2"])
def test_verify_runs_a_pipeline_plans_window_on_every_pipeline_rank_and_measures_its_peak(
        model_file, layout, budget, world):
    """autotune verify ran a pipeline plan's model as one module (PipelinedModel has no forward),
    and the plan stated a sync-on-last window of 3 of its 4 micro-batches (266 KiB below its own
    window on tiny_lm): a pipeline's schedule reduces its gradients on the last backward whatever
    the plan says, so its peak is the probe's window trial, which verify measures on every
    pipeline rank (real tensors, a fake process group), to the bytes."""
    import autotune

    plan = autotune.plan(model_file, target_batch=16, world_size=world, sharding="fsdp", precision="fp32",
                         checkpointing="off", memory_limit=budget, **layout)
    assert plan.micro_batches == [4, 4, 4, 4] and plan.parallel.pp == 2
    result = autotune.verify_plan(plan, workload=model_file, steps=1)
    assert result.confirmed
    assert abs(result.measured_peak_bytes - plan.predicted_peak_bytes) <= 64, (result.measured_peak_bytes, plan)


def test_a_pipelines_copies_of_the_fake_model_stay_in_its_fake_mode():
    # Deep-copying a FakeTensor copies its fake mode, and with it a second StorageWeakRef of each
    # of the first mode's constants on one weak reference: both free it, and the second write
    # went into a freed StorageImpl (glibc aborted a process or two pipeline probes later).
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autotune.distributed import pipeline

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
        torch.tensor(2.0)  # a constant: the mode's converter holds a StorageWeakRef of it
    converter = mode.fake_tensor_converter
    assert converter.constant_storage_mapping  # BatchNorm1d's num_batches_tracked is one too
    stage = pipeline._copy_model(model)
    shapes = pipeline._ShapeModel(model, "", [1, 3], lambda m, batch: m(batch).sum())
    for copied in (stage, shapes.model):
        tensors = [*copied.parameters(), *copied.buffers()]
        assert tensors and all(t.fake_mode is mode for t in tensors)
    assert stage[0].weight is not model[0].weight  # copies all the same
    assert shapes.outputs(torch.zeros(2, 4)) == {1: ((2, 4), torch.float32), 3: ((2, 2), torch.float32)}
