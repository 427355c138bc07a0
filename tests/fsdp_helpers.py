"""Run tests/fsdp_peak_script.py under torchrun and read its per-rank peaks."""

import json
import os
import subprocess
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def real_fsdp_peaks(model_file, world_size: int, sizes, out_dir: Path, *, precision="fp32",
                    checkpointing=False, repeats: int = 3, cp: int = 1,
                    tp: int = 1) -> dict[int, list[list[int]]]:
    """{n: per-rank lists of ``repeats`` peaks} from a real FSDP2 run of ``world_size`` gloo ranks
    (context parallel over groups of ``cp``; tensor parallel over groups of ``tp``)."""
    return {int(n): ranks for n, ranks in _run(model_file, world_size, sizes, out_dir, precision,
                                               checkpointing, FSDP_REPEATS=str(repeats),
                                               FSDP_CP=str(cp), FSDP_TP=str(tp))["peaks"].items()}


def real_fsdp_fits(model_file, world_size: int, sizes, out_dir: Path, *, memory_limit: int,
                   shard_group=None, precision="fp32", checkpointing=False) -> dict[int, list[list[bool]]]:
    """{n: per-rank lists of whether each repeated step fitted ``memory_limit`` bytes}."""
    report = _run(model_file, world_size, sizes, out_dir, precision, checkpointing,
                  FSDP_MEMORY_LIMIT=str(memory_limit), FSDP_SHARD_GROUP=str(shard_group or ""))
    return {int(n): ranks for n, ranks in report["fits"].items()}


def _run(model_file, world_size, sizes, out_dir, precision, checkpointing, **extra_env) -> dict:
    out = Path(out_dir) / (f"peaks-{Path(model_file).stem}-{world_size}-cp{extra_env.get('FSDP_CP', 1)}"
                          f"-tp{extra_env.get('FSDP_TP', 1)}.json")
    env = dict(os.environ, OMP_NUM_THREADS="1", **extra_env,
               PYTHONPATH=os.pathsep.join([str(TESTS.parent), os.environ.get("PYTHONPATH", "")]))
    from conftest import rank_command

    command = rank_command(world_size, TESTS / "fsdp_peak_script.py", model_file, out, precision,
                           "on" if checkpointing else "off", *sizes)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(done.stderr[-4000:])
    return json.loads(out.read_text())


def steady_peak(ranks: list[list[int]]) -> int:
    """The largest rank's smallest peak over the repeats: the step where gloo's worker threads
    happened to let go of every collective's buffers at once."""
    return max(min(peaks) for peaks in ranks)


def typical_peak(ranks: list[list[int]]) -> int:
    """The largest rank's median peak over the repeats: what most steps reach. A rare step reaches
    more, where a gloo worker thread lets go of a finished all-gather's output just after the
    peak instead of before it (seen once in CI: +5.4% on one repeat of six, gpt_varlen at world 2)."""
    return max(sorted(peaks)[len(peaks) // 2] for peaks in ranks)


def worst_peak(ranks: list[list[int]]) -> int:
    """The largest peak of any rank and repeat: the step where a gloo worker thread let go of a
    collective's buffers late (what a plan must leave room for; the estimate counts it)."""
    return max(max(peaks) for peaks in ranks)
