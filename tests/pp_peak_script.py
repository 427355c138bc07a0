"""Run under torchrun (gloo, CPU): each rank's peak of a pipelined window, measured for real.

    torchrun --nproc-per-node W tests/pp_peak_script.py MODEL.py OUT.json PP SCHEDULE STAGES_PER_RANK SHARDING ACCUM N [N ...]

Every rank runs the probe's pipelined window (the schedule over ACCUM micro-batches of N, then
the optimizer) PP_REPEATS times (default 3) with the CPU memory backend; rank 0 writes
{"peaks": {N: [[rank 0's peaks], [rank 1's], ...]}} to OUT.json.
"""

import json
import os
import sys

import torch.distributed as dist

from autotune.distributed.collectives import settle
from autotune.distributed.pipeline import pipelined_step
from autotune.memory.cpu import CPUMemoryBackend
from autotune.precision import Precision
from autotune.probing.pipeline_trial import PipelineTrialSession
from autotune.workload import load_workload

REPEATS = int(os.environ.get("PP_REPEATS", "3"))

model_file, out, pp, schedule, stages_per_rank, sharding, accumulation, *sizes = sys.argv[1:]
dist.init_process_group("gloo")
world = dist.get_world_size()
peaks = {}
with pipelined_step(load_workload(model_file), pp=int(pp), world_size=world, schedule=schedule,
                    stages_per_rank=int(stages_per_rank), sharding=sharding) as workload:
    with PipelineTrialSession(workload, CPUMemoryBackend(), precision=Precision.FP32, sharded=True) as session:
        for n in map(int, sizes):
            trials = [session.run(n, window=int(accumulation)) for _ in range(REPEATS)]
            mine = [t.peak_bytes for t in trials]
            if os.environ.get("PP_DEBUG"):
                print(dist.get_rank(), n, [(t.activation_peak_bytes, t.step_peak_bytes, t.baseline_bytes) for t in trials], flush=True)
            every = [None] * world
            dist.all_gather_object(every, mine)
            peaks[n] = every
if dist.get_rank() == 0:
    with open(out, "w") as f:
        json.dump({"peaks": peaks}, f)
settle()
dist.destroy_process_group()
