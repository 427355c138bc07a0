"""The sequence length as a planned dimension: make_batch(batch_size, seq_len), probe_seq_len
(autotune probe --max-seq-len), plans in tokens (--seq-len, --target-tokens) and packed rows."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

pytest.importorskip("transformers")

import autotune  # noqa: E402
from autotune.cli.main import cli  # noqa: E402
from autotune.memory import backend_for  # noqa: E402
from autotune.precision import Precision  # noqa: E402
from autotune.probing.trial import TrialSession  # noqa: E402
from autotune.workload.contract import takes_seq_len  # noqa: E402

from seq_len_models import POSITIONS, build_gpt2, build_llama, make_batch  # noqa: E402

HERE = Path(__file__).parent
ROOT = HERE.parent
PACKED = ROOT / "examples" / "real" / "llama_packed.py"


def bisect_seq_len(workload, memory_limit: str, *, micro_batch: int = 1, multiple: int = 1,
                   limit: int = POSITIONS) -> int:
    """The longest length (a multiple of ``multiple``, up to ``limit``) whose real training step
    fits, by plain bisection over real steps (the reference the probe's search must equal)."""
    length = [multiple]
    stepped = dataclasses.replace(workload, make_batch=lambda n: workload.batch(n, length[0]))
    session = TrialSession(stepped, backend_for("cpu", memory_limit), precision=Precision.FP32)
    lo, hi = 0, limit // multiple + 1
    with session:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            length[0] = mid * multiple
            lo, hi = (mid, hi) if session.run(micro_batch).fits else (lo, mid)
    return lo * multiple


@pytest.mark.parametrize("build, memory_limit, multiple", [
    pytest.param(build_gpt2, "4MiB", 1, marks=pytest.mark.slow, id="gpt2"),
    pytest.param(build_gpt2, "3MiB", 8, marks=pytest.mark.slow, id="gpt2-multiple-8"),
    pytest.param(build_llama, "2MiB", 8, id="llama-multiple-8"),
    pytest.param(build_llama, "3MiB", 1, marks=pytest.mark.slow, id="llama")])
def test_max_seq_len_equals_bisection_over_real_steps(build, memory_limit, multiple):
    workload = autotune.Workload(model=build, make_batch=make_batch)
    found = autotune.probe_seq_len(workload, memory_limit=memory_limit, device="cpu",
                                   seq_multiple=multiple)
    exact = bisect_seq_len(workload, memory_limit, multiple=multiple)
    assert 0 < exact < POSITIONS  # the budget, not the model's limit, decides
    assert found.max_seq_len == exact
    assert found.max_seq_len % multiple == 0 and not found.capped
    fits = {t.seq_len: t.fits for t in found.trials}
    assert fits[exact] and fits[exact + multiple] is False  # the proof: a fit and a failure
    assert len(found.trials) <= 3  # seeded by the estimate on fake tensors


def test_max_seq_len_stops_at_the_model_limit():
    workload = autotune.Workload(model=build_llama, make_batch=make_batch)
    found = autotune.probe_seq_len(workload, memory_limit="64MiB", device="cpu", max_seq_len=96,
                                   seq_multiple=32, use_estimate=False)
    assert (found.max_seq_len, found.capped) == (96, True)
    assert max(t.seq_len for t in found.trials) == 96  # never past the limit


def test_two_argument_make_batch_is_read_from_the_signature():
    def one(batch_size): ...
    def two(batch_size, seq_len): ...
    def default(batch_size, seq_len=128): ...
    def other(batch_size, seed=0): ...
    def keyword_only(batch_size, *, seq_len=8): ...
    assert [takes_seq_len(f) for f in (one, two, default, other, keyword_only)] == [
        False, True, True, False, False]
    workload = autotune.Workload(model=build_gpt2, make_batch=make_batch)
    assert tuple(workload.batch(3)["input_ids"].shape) == (3, 64)  # one-argument calls still work
    assert tuple(workload.at_seq_len(40).batch(2)["input_ids"].shape) == (2, 40)


def test_a_make_batch_that_ignores_seq_len_is_refused():
    workload = autotune.Workload(model=build_gpt2,
                                 make_batch=lambda batch_size, seq_len: make_batch(batch_size, 64))
    with pytest.raises(autotune.WorkloadError, match="none with 32 positions"):
        workload.batch(2, 32)


def test_cli_refuses_bad_sequence_options():
    runner = CliRunner()
    mlp = str(ROOT / "examples" / "mlp.py")
    one_arg = runner.invoke(cli, ["probe", mlp, "--max-seq-len", "--memory-limit", "8MiB"])
    assert one_arg.exit_code == 1 and "make_batch(batch_size, seq_len)" in one_arg.output
    planned = runner.invoke(cli, ["plan", mlp, "--target-batch", "8", "--seq-len", "64", "-o",
                                  "/tmp/seqlen_never.json"])
    assert planned.exit_code == 1 and "make_batch(batch_size, seq_len)" in planned.output
    zero = runner.invoke(cli, ["plan", str(HERE / "seq_gpt2_model.py"), "--target-tokens", "64",
                               "--seq-len", "0"])
    assert zero.exit_code == 2 and "'0' is not a sequence length" in zero.output
    uneven = runner.invoke(cli, ["plan", str(HERE / "seq_gpt2_model.py"), "--target-tokens", "1000",
                                 "--seq-len", "128", "--world-size", "2", "-o", "/tmp/seqlen_never.json"])
    assert uneven.exit_code == 2  # a ConfigError: the options cannot work together
    assert "--target-tokens 768 or 1024" in uneven.output and "multiple of 256" in uneven.output
    both = runner.invoke(cli, ["plan", str(HERE / "seq_gpt2_model.py"), "--target-tokens", "1024",
                               "--target-batch", "8", "--seq-len", "128"])
    assert both.exit_code == 2 and "give one of them" in both.output
    stray = runner.invoke(cli, ["probe", mlp, "--seq-multiple", "8"])
    assert stray.exit_code == 2 and "--max-seq-len" in stray.output
    assert not Path("/tmp/seqlen_never.json").exists()


@pytest.mark.slow  # plans and trains end to end: 20-45 s, the fast suite's heaviest
def test_a_token_plan_trains_exactly_its_tokens_per_optimizer_step(tmp_path):
    fed = []

    def loss_fn(model, batch):
        fed.append(batch["input_ids"].numel())
        return model(**batch).loss

    workload = autotune.Workload(model=build_gpt2, make_batch=make_batch, loss_fn=loss_fn)
    plan = autotune.plan(workload, target_tokens=1536, seq_len=96, memory_limit="4MiB",
                         precision="fp32", checkpointing="off", device="cpu")
    assert (plan.seq_len, plan.target_tokens, plan.tokens_per_step) == (96, 1536, 1536)
    assert plan.accumulation_steps > 1
    assert plan.reasons["batch_shapes"].endswith(
        f"make_batch({plan.micro_batch}, 96): input_ids ({plan.micro_batch}, 96), labels ({plan.micro_batch}, 96)")
    path = autotune.save_plan(plan, tmp_path / "plan.json")
    saved = json.loads(path.read_text())
    assert (saved["seq_len"], saved["target_tokens"], saved["derived"]["tokens_per_step"]) == (96, 1536, 1536)
    fed.clear()
    autotune.train(autotune.load_plan(path), workload, steps=2, progress=False)
    steps = plan.accumulation_steps
    assert len(fed) == 2 * steps
    assert [sum(fed[i * steps:(i + 1) * steps]) for i in range(2)] == [1536, 1536]
    show = CliRunner().invoke(cli, ["show", str(path)])
    assert "tokens:       1,536 per optimizer step = 16 sequences × seq len 96" in show.output
    fed.clear()
    checked = autotune.verify_plan(path, workload=workload, memory_limit="4MiB", replan=False)
    assert checked.confirmed and set(fed) == {plan.micro_batch * 96}  # verify runs the plan's length
    saved["target_tokens"] = 1000  # a file whose numbers disagree is refused
    path.write_text(json.dumps(saved))
    with pytest.raises(autotune.PlanFileError, match="target_tokens is 1000"):
        autotune.load_plan(path)


def test_packed_rows_attend_within_documents_and_count_real_tokens():
    workload = autotune.load_workload(PACKED)
    batch = workload.batch(2, 192)
    assert {k: tuple(v.shape) for k, v in batch.items()} == {
        "input_ids": (2, 192), "position_ids": (2, 192), "labels": (2, 192)}
    model = workload.new_model().eval()
    documents = 0
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                       use_cache=False).logits
        for row in range(2):
            starts = (batch["position_ids"][row] == 0).nonzero().flatten().tolist() + [192]
            documents += len(starts) - 1
            for start, stop in zip(starts[:-1], starts[1:]):
                alone = model(input_ids=batch["input_ids"][row:row + 1, start:stop],
                              use_cache=False).logits[0]
                torch.testing.assert_close(packed[row, start:stop], alone, atol=1e-5, rtol=1e-5)
    assert documents > 2  # rows hold several documents
    model.train()
    _, count = workload.loss(model, batch)
    # Every position but the last predicts the next token, except across a document boundary.
    boundaries = int((batch["position_ids"][:, 1:] == 0).sum())
    assert int(count) == 2 * 191 - boundaries


@pytest.mark.slow
def test_seq_len_auto_takes_the_longest_length_that_divides_the_tokens():
    workload = autotune.Workload(model=build_gpt2, make_batch=make_batch)
    plan = autotune.plan(workload, target_tokens=4096, seq_len="auto", memory_limit="8MiB",
                         precision="fp32", checkpointing="off", device="cpu", seq_multiple=8)
    # The longest whose accumulation micro-step fits at micro-batch 1 within the budget less the
    # headroom, measured the same way here:
    longest = autotune.probe_seq_len(workload, memory_limit=int(8 * 2**20 * 0.9), device="cpu",
                                     seq_multiple=8, accumulation=True).max_seq_len
    dividing = [n for n in range(8, longest + 1, 8) if 4096 % n == 0]
    assert plan.seq_len == max(dividing) and plan.tokens_per_step == 4096
    assert f"is {longest}" in plan.reasons["seq_len"]
    trained = autotune.train(plan, workload, steps=1, progress=False)
    assert trained.steps == 1


@pytest.mark.slow
def test_cli_max_seq_len_prints_the_probe_answer():
    result = CliRunner().invoke(cli, ["probe", str(HERE / "seq_llama_model.py"), "--max-seq-len",
                                      "--memory-limit", "2MiB", "--seq-multiple", "8", "--json"])
    assert result.exit_code == 0, result.output
    found = json.loads(result.output[result.output.index("{"):])
    workload = autotune.load_workload(HERE / "seq_llama_model.py")
    assert found["max_seq_len"] == bisect_seq_len(workload, "2MiB", multiple=8)
    assert found["micro_batch"] == 1 and found["seq_multiple"] == 8


def test_the_plan_states_the_dataset_shapes_the_probe_measured():
    from autotune.orchestration.tokens import batch_shapes

    lengths = [5, 17, 9, 12]

    def pad(examples):
        return torch.nn.utils.rnn.pad_sequence(examples, batch_first=True)

    workload = autotune.Workload(model=torch.nn.Linear(2, 2), collate_fn=pad,
                                 build_dataset=lambda: [torch.ones(n, dtype=torch.long) for n in lengths])
    assert batch_shapes(workload, 2) == ("measured at the planned micro-batch 2 on build_dataset()'s "
                                         "largest examples, collated: [0] (2, 17)")


def test_training_refuses_dataset_sequences_longer_than_the_plan():
    from autotune.planning.types import WorkloadFingerprint

    workload = autotune.Workload(
        model=build_gpt2, make_batch=make_batch,
        build_dataset=lambda: [{"input_ids": torch.arange(n) % 100, "labels": torch.arange(n) % 100}
                               for n in (8, 8, 24, 8)],
        collate_fn=lambda examples: {key: torch.nn.utils.rnn.pad_sequence(
            [e[key] for e in examples], batch_first=True) for key in examples[0]})
    plan = autotune.Plan(target_batch=4, world_size=1, micro_batches=[2, 2], precision="fp32",
                         checkpointing="off", lr=autotune.LRDecision(rule="none"), seq_len=16,
                         workload=WorkloadFingerprint(source="<python objects>", file_sha256=None,
                                                      param_count=1, param_bytes=4))
    with pytest.raises(autotune.WorkloadError, match="sequences of 24 positions, but the plan was "
                                                     "probed at seq_len 16"):
        autotune.train(plan, workload, steps=1, progress=False, measure_noise_scale=False)


def test_max_seq_len_says_when_the_state_alone_does_not_fit():
    workload = autotune.Workload(model=build_llama, make_batch=make_batch)
    with pytest.raises(autotune.ProbeError, match="optimizer state alone pass the 300.00 KiB budget"):
        autotune.probe_seq_len(workload, memory_limit="300KiB", device="cpu", use_estimate=False)


def test_a_seq_multiple_past_the_models_positions_is_named_as_the_cause():
    # No length was tried, and the error blamed the parameters and optimizer state ("pass the
    # 8.00 MiB budget, whatever the length") for a model of 0.4 MiB.
    model = Path(__file__).resolve().parent.parent / "examples" / "real" / "llama_packed.py"
    with pytest.raises(autotune.ConfigError, match=r"seq_multiple=5000 is past the model's "
                                                   r"max_position_embeddings \(4096\).*at most 4096"):
        autotune.probe_seq_len(model, seq_multiple=5000, device="cpu", memory_limit="8MiB")
