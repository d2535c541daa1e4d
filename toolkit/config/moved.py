"""Where the public names of ``toolkit.training`` went when they got rooms of their own (issue 41), for what was
written before: recipes copied earlier (``toolkit.training`` hands the names on, lazily), configs and the step
checkpoints' ``config.yaml`` that name ``toolkit.training.<Name>`` as a ``_component_`` (they build, resume and
export as the new paths do: :func:`current_path`).

Kept in the config room, the lowest that reads ``_component_`` paths, as plain strings: it imports none of the rooms
it names, so the checkpoint reader and ``tune export`` use it without touching the training room.
"""

# A name that moved to another room -> that room (one line each).
MOVED = {
    "HFCheckpointer": "toolkit.checkpoint",
    "MetaCheckpointer": "toolkit.checkpoint",
    "StepCheckpointer": "toolkit.checkpoint",
    "TrainingState": "toolkit.checkpoint",
    "claim_output_dir": "toolkit.checkpoint",
    "find_resume_checkpoint": "toolkit.checkpoint",
    "gather_full_state_dict": "toolkit.checkpoint",
    "latest_checkpoint": "toolkit.checkpoint",
    "load_model_family": "toolkit.checkpoint",
    "prepare_output_dir": "toolkit.checkpoint",
    "start_run": "toolkit.checkpoint",
    "chunked_cross_entropy_sum": "toolkit.modules.loss",
    "cross_entropy_sum": "toolkit.modules.loss",
    "Muon": "toolkit.optim",
    "OptimizerInBackward": "toolkit.optim",
    "check_optimizer_in_backward": "toolkit.optim",
    "cosine_with_warmup": "toolkit.optim",
    "fused_by_default": "toolkit.optim",
    "optimizer_parameters": "toolkit.optim",
    "DistributedEnv": "toolkit.parallel",
    "ParallelDims": "toolkit.parallel",
    "STRATEGIES": "toolkit.parallel",
    "all_reduce_sum": "toolkit.parallel",
    "apply_data_parallel": "toolkit.parallel",
    "apply_ddp": "toolkit.parallel",
    "apply_fsdp": "toolkit.parallel",
    "barrier": "toolkit.parallel",
    "clip_grad_norm": "toolkit.parallel",
    "destroy_distributed": "toolkit.parallel",
    "gradient_sync": "toolkit.parallel",
    "init_distributed": "toolkit.parallel",
    "on_rank_zero": "toolkit.parallel",
    "parallel_dims": "toolkit.parallel",
    "shard_optimizer_state": "toolkit.parallel",
    "unwrap": "toolkit.parallel",
    "ParallelPlan": "toolkit.planning",
    "StepKernels": "toolkit.planning",
    "choose_layout": "toolkit.planning",
    "choose_strategy": "toolkit.planning",
    "estimate_memory": "toolkit.planning",
    "optimizer_memory_model": "toolkit.planning",
    "plan_parallelism": "toolkit.planning",
}


def current_path(dotted: str) -> str:
    """A ``_component_`` path as it is named today: ``toolkit.training.HFCheckpointer``, as configs (and the step
    checkpoints' ``config.yaml``) written before the move name it, is ``toolkit.checkpoint.HFCheckpointer``; any
    other path is itself."""
    package, _, name = dotted.rpartition(".")
    return f"{MOVED[name]}.{name}" if package == "toolkit.training" and name in MOVED else dotted
