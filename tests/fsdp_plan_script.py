"""Run under torchrun (gloo, CPU) by test_plan_sharding.py: plan with every rank measuring FSDP2.

    torchrun --nproc-per-node 2 tests/fsdp_plan_script.py MODEL.py OUT.json
"""

import sys

import torch.distributed as dist

from autotune import plan, save_plan

model_file, out = sys.argv[1:]
dist.init_process_group("gloo")
result = plan(model_file, target_batch=64, device="cpu", memory_limit="40MiB", precision="fp32",
              checkpointing="off", sharding="fsdp")
save_plan(result, out if dist.get_rank() == 0 else f"{out}.rank{dist.get_rank()}")
dist.destroy_process_group()
