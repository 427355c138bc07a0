"""Run under torchrun (gloo, CPU): each rank's peak of a pipelined window, measured for real.

    torchrun --nproc-per-node W tests/pp_peak_script.py MODEL.py OUT.json PP SCHEDULE SHARDING ACCUM N [N ...]

Every rank runs the probe's pipelined window (the schedule over ACCUM micro-batches of N, then
the optimizer) PP_REPEATS times (default 3) with the CPU memory backend, the model split by the
same ``sharded_step`` the estimate uses (PP_TP=T: tensor parallel over groups of T inside
each stage; PP_CP=C: each sequence sharded over C context-parallel ranks); rank 0 writes {"peaks": {N: [[rank 0's peaks], ...]}}
to OUT.json.
"""

import json
import os
import sys

import torch.distributed as dist

from autotune.distributed.collectives import settle
from autotune.distributed.layout import parse_layout
from autotune.distributed.sharding.ranks import sharded_step
from autotune.memory.cpu import CPUMemoryBackend
from autotune.precision import Precision
from autotune.probing.pipeline_trial import pipelined_session_type
from autotune.probing.trial import TrialSession
from autotune.workload import load_workload

REPEATS = int(os.environ.get("PP_REPEATS", "3"))

model_file, out, pp, schedule, sharding, accumulation, *sizes = sys.argv[1:]
dist.init_process_group("gloo")
world = dist.get_world_size()
parallel = parse_layout(pp=int(pp), pp_schedule=schedule, tp=int(os.environ.get("PP_TP", "1")),
                        cp=int(os.environ.get("PP_CP", "1")))
peaks = {}
with sharded_step(load_workload(model_file), sharding=sharding, world_size=world,
                  parallel=parallel) as workload:
    session_type = pipelined_session_type(TrialSession)
    with session_type(workload, CPUMemoryBackend(), precision=Precision.FP32, parallel=parallel) as session:
        for n in map(int, sizes):
            mine = [session.run(n, window=int(accumulation)).peak_bytes for _ in range(REPEATS)]
            every = [None] * world
            dist.all_gather_object(every, mine)
            peaks[n] = every
if dist.get_rank() == 0:
    with open(out, "w") as f:
        json.dump({"peaks": peaks}, f)
settle()
dist.destroy_process_group()
