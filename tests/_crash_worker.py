"""Worker for tests/test_launch.py: rank 1 dies of SIGABRT (as a C++ abort would) while rank 0 waits for it in a
collective. The fault handler is on, as in tests/_recipe_runs_worker.py."""

import faulthandler
import os
import sys

import torch.distributed as dist

faulthandler.enable(all_threads=True)
dist.init_process_group("gloo")
print(f"rank {os.environ['RANK']} up", file=sys.stderr, flush=True)
if os.environ["RANK"] == "1":
    os.abort()
dist.barrier()
