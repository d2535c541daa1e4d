"""Worker for ``tests.launch.run_recipes``, run under torchrun: several recipe runs one after another in one process
group, each configured and validated as `tune run <recipe>_distributed` does it before launching, then the
recipe's ``main(cfg)`` called, as its torchrun workers call it.

The recipes' ``main`` leaves the process group at its end (``destroy_distributed``); here the group stays for the
next run and is left once, after the last (a group cannot be formed again on the same store: the new ranks would
read the old group's addresses). Everything else a run builds (meshes, FSDP2 or DDP modules, optimizers, data) is
its own, built afresh from its config and seed.
"""

import contextlib
import faulthandler
import gc
import json
import os
import runpy
import sys
import time
import traceback
from pathlib import Path

import torch.distributed as dist

import toolkit.training
from toolkit.cli._catalog import config_for_recipe, recipe_path, recipe_schema
from toolkit.config import apply_overrides, load_config, recipe_keys, validate
from toolkit.training.debug import FAULT_ENV


def run(recipe: str, config: str, output_dir: str, overrides: list[str], stdout: str) -> None:
    path = recipe_path(f"{recipe}_distributed")
    cfg = load_config(config_for_recipe(config, recipe))
    keys = recipe_keys(path)
    writes = keys is None or "output_dir" in keys.reads
    apply_overrides(cfg, [f"output_dir={output_dir}"] * writes + overrides, recipe=keys)
    validate(cfg, schema=recipe_schema(path), world_size=int(os.environ["WORLD_SIZE"]))
    main = runpy.run_path(str(path))["main"]
    rank_zero = os.environ["RANK"] == "0"
    with open(stdout if rank_zero else os.devnull, "w") as out, contextlib.redirect_stdout(out):
        main(cfg)


if __name__ == "__main__":
    # A rank that dies of a signal (an abort in C++) prints every thread's Python stack to its stderr first.
    faulthandler.enable(all_threads=True)
    runs = json.loads(Path(sys.argv[1]).read_text())
    os.environ.pop(FAULT_ENV, None)  # nothing injected, whatever the test's own environment holds
    toolkit.parallel.destroy_distributed = lambda: None  # what the recipes import: the group is kept (see above)
    try:
        for spec in runs:
            start = time.perf_counter()
            run(**spec)
            gc.collect()  # the run's models, and the gloo work they hold, freed before the next run
            if dist.is_initialized():
                dist.barrier()
            if os.environ["RANK"] == "0":
                print(f"{spec['recipe']} {spec['output_dir']} {' '.join(spec['overrides'])}: "
                      f"{time.perf_counter() - start:.1f} s",
                      file=sys.stderr)
    except BaseException:
        # Leave at once, as a crashed recipe worker does: the other ranks would wait for this one at the next
        # collective; the launcher stops them when it sees this exit.
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    dist.barrier()
    dist.destroy_process_group()
    # And skip interpreter teardown, as the recipes' torchrun workers do (toolkit.config.recipe_main): torch 2.13's
    # gloo destructors can abort there after all work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
