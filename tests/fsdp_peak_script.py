"""Run under torchrun (gloo, CPU): the per-rank peak of the probe's step under real FSDP2.

    torchrun --nproc-per-node W tests/fsdp_peak_script.py MODEL.py OUT.json PRECISION CKPT N [N ...]

Every rank measures each micro-batch FSDP_REPEATS times (default 3) with the CPU memory backend;
rank 0 writes
{"world_size": W, "peaks": {N: [[rank 0's peaks], [rank 1's], ...]}, "fits": {N: [[...], ...]}}
to OUT.json. FSDP_MEMORY_LIMIT (bytes) gives each rank that budget; FSDP_SHARD_GROUP shards within
groups of that many ranks; FSDP_CP shards every sequence over groups of that many ranks (context
parallelism); FSDP_TP splits each layer over groups of that many ranks (tensor parallelism).
"""

import json
import os
import sys

import torch.distributed as dist

from autotune.distributed.collectives import settle
from autotune.distributed.layout import Layout
from autotune.memory.cpu import CPUMemoryBackend
from autotune.precision import Precision
from autotune.probing.trial import TrialSession
from autotune.distributed.sharding.ranks import sharded_step
from autotune.workload import load_workload

REPEATS = int(os.environ.get("FSDP_REPEATS", "3"))

model_file, out, precision, checkpointing, *sizes = sys.argv[1:]
dist.init_process_group("gloo")
world = dist.get_world_size()
limit = os.environ.get("FSDP_MEMORY_LIMIT")
group = os.environ.get("FSDP_SHARD_GROUP")
parallel = Layout(cp=int(os.environ.get("FSDP_CP") or 1), tp=int(os.environ.get("FSDP_TP") or 1))
parallel = None if parallel.trivial else parallel
peaks, fits = {}, {}
with sharded_step(load_workload(model_file), sharding="fsdp", world_size=world,
                  shard_group=int(group) if group else None, precision=precision,
                  parallel=parallel) as workload:
    backend = CPUMemoryBackend(int(limit) if limit else None)
    with TrialSession(workload, backend, precision=Precision.parse(precision),
                      checkpointing=checkpointing == "on", sharded=True, parallel=parallel) as session:
        for n in map(int, sizes):
            trials = [session.run(n) for _ in range(REPEATS)]
            for name, mine in (("peaks", [t.peak_bytes for t in trials]),
                               ("fits", [t.fits for t in trials])):
                every = [None] * world
                dist.all_gather_object(every, mine)
                (peaks if name == "peaks" else fits)[n] = every
if dist.get_rank() == 0:
    with open(out, "w") as f:
        json.dump({"world_size": world, "peaks": peaks, "fits": fits}, f)
settle()  # gloo's workers let go of every tensor before this rank exits
dist.destroy_process_group()
