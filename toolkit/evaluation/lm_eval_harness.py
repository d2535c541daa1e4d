"""lm-evaluation-harness tasks on a toolkit model, when ``lm-eval`` is installed (the ``eval`` extra).

:func:`load_lm_eval_tasks` imports ``lm_eval`` and finds the tasks, and :func:`check_chat_settings` checks the chat
template settings (both before any model is loaded, so that a missing package, a misspelled task or a tokenizer
without a chat template fails at once); :func:`run_lm_eval` runs the tasks through
:class:`toolkit.evaluation.lm_eval_model.ToolkitLM` and returns each task's metrics.
"""

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from toolkit.config import did_you_mean
from toolkit.errors import UserError
from toolkit.evaluation.chat_template import ChatTemplate
from toolkit.paths import install_command


@dataclass(frozen=True)
class LMEvalTasks:
    """Task names checked against lm-eval's index, and the ``lm_eval.tasks.TaskManager`` that found them."""

    names: list[str]
    manager: Any


def load_lm_eval_tasks(
    tasks: str | Sequence[str], *, include_path: str | Path | None = None, include_defaults: bool = True
) -> LMEvalTasks:
    """Import lm-eval and check that every task (or group, or tag) name is known to it.

    Args:
        tasks: lm-eval task, group or tag names (a single name is a list of one).
        include_path: a folder of task YAML files of your own, indexed along with lm-eval's.
        include_defaults: also index lm-eval's own tasks (some 15,000 names, a few seconds); ``False`` when all the
            tasks are under ``include_path``.

    Raises:
        UserError: lm-eval (or one of its dependencies) is not installed, a name is unknown, or ``include_path`` is
            not a folder.
    """
    try:
        from lm_eval.tasks import TaskManager
    except ModuleNotFoundError as e:
        missing = (e.name or "lm_eval").partition(".")[0]  # lm_eval itself, or one of its dependencies
        raise UserError(f"lm_eval.tasks needs lm-evaluation-harness (no module named {missing!r}): "
                        f"{install_command('eval')}") from None
    names = [tasks] if isinstance(tasks, str) else [str(name) for name in tasks]
    if not names:
        raise UserError("lm_eval.tasks: no task named (null turns lm-evaluation-harness off)")
    if include_path is not None:
        include_path = Path(include_path).expanduser()
        if not include_path.is_dir():
            raise UserError(f"lm_eval.include_path: {include_path} is not a folder")
    elif not include_defaults:
        raise UserError("lm_eval.include_defaults: false leaves no task to run without an include_path")
    manager = TaskManager(include_path=None if include_path is None else str(include_path), include_defaults=include_defaults)
    searched = " and ".join(
        place
        for place, used in [("lm-eval's own tasks", include_defaults), (f"the task files under {include_path}", include_path)]
        if used
    )
    known = set(manager.all_tasks)
    for name in names:
        if name not in known:
            raise UserError(f"lm_eval.tasks: no task {name!r} among {searched}{did_you_mean(name, known)}")
    return LMEvalTasks(names=names, manager=manager)


def check_chat_settings(tokenizer, *, apply_chat_template: bool, fewshot_as_multiturn: bool) -> None:
    """Check lm-eval's chat template settings against each other and the tokenizer (no model needed, so a recipe
    can check them before it loads one).

    Raises:
        UserError: a setting that is not a boolean, ``fewshot_as_multiturn`` without ``apply_chat_template``, or a
            tokenizer without a chat template asked to apply one.
    """
    for key, value in [("apply_chat_template", apply_chat_template), ("fewshot_as_multiturn", fewshot_as_multiturn)]:
        if not isinstance(value, bool):
            # lm-eval also takes a template's name for Hugging Face tokenizers; ours have one chat format each.
            raise UserError(f"lm_eval.{key} must be true or false, got {value!r}")
    if fewshot_as_multiturn and not apply_chat_template:
        raise UserError(
            "lm_eval.fewshot_as_multiturn: true needs lm_eval.apply_chat_template: true (lm-eval's rule: the few-shot "
            "examples become earlier user and assistant turns of the chat)"
        )
    if apply_chat_template:
        ChatTemplate(tokenizer)


def run_lm_eval(
    model: nn.Module,
    tokenizer,
    tasks: LMEvalTasks,
    *,
    limit: int | float | None = None,
    num_fewshot: int | None = None,
    apply_chat_template: bool = False,
    fewshot_as_multiturn: bool = False,
    system_instruction: str | None = None,
    batch_size: int = 16,
    autocast: contextlib.AbstractContextManager | None = None,
    rank: int = 0,
    world_size: int = 1,
    group: dist.ProcessGroup | None = None,
    seed: int = 0,
) -> dict[str, dict] | None:
    """Run lm-eval's ``simple_evaluate`` on ``tasks`` with ``model``; a collective when ``world_size > 1``.

    Every process runs the harness on every document and shares the model's work with the others (see
    :class:`~toolkit.evaluation.lm_eval_model.ToolkitLM`). lm-eval's own seeds (for few-shot sampling) apply, so
    numbers compare with other lm-eval runs.

    Args:
        model: a plain decoder, or one sharded in place by FSDP2.
        tokenizer: the model's tokenizer, built with ``max_seq_len=None`` (the adapter truncates from the left).
        tasks: from :func:`load_lm_eval_tasks`.
        limit: documents per task (a fraction below 1: that share of each task); ``None``: all.
        num_fewshot: examples in each prompt; ``None``: each task's own default.
        apply_chat_template: render each prompt as a conversation in the tokenizer's chat format (an instruction
            or chat fine-tune is prompted as it was trained), as lm-eval's option of that name.
        fewshot_as_multiturn: with ``apply_chat_template``, the few-shot examples as earlier user and assistant
            turns; otherwise they and the question make one user message.
        system_instruction: a system message opening every prompt (without chat templates, text before it).
        batch_size: sequences per forward pass when scoring.
        autocast: forward-pass context (mixed precision without FSDP2).
        rank, world_size: this process among those that share the work (under tensor parallelism, its
            data-parallel rank and size: the ranks of a TP group do the same work together).
        group: the process group of those ``world_size`` processes (default: all).
        seed: seeds sampled generations.

    Returns:
        On ``rank`` 0, ``{task: {"metrics": {name: value}, "num_fewshot": n, "samples": n}}`` for every task and group
        lm-eval reports (a group's samples: those of its tasks). Metric names are lm-eval's (``acc``, ``acc_stderr``,
        ``exact_match``...); a filter other than the default stays after a comma (``exact_match,strict-match``).
        ``None`` on other ranks, and on a process that is not its node's first (lm-eval returns nothing there).

    Raises:
        UserError: as :func:`check_chat_settings`.
    """
    from lm_eval.evaluator import simple_evaluate

    from toolkit.evaluation.lm_eval_model import ToolkitLM

    check_chat_settings(tokenizer, apply_chat_template=apply_chat_template, fewshot_as_multiturn=fewshot_as_multiturn)
    lm = ToolkitLM(
        model, tokenizer, batch_size=batch_size, autocast=autocast, rank=rank, world_size=world_size, group=group,
        seed=seed, apply_chat_template=apply_chat_template,
    )
    # The chat settings are always passed: lm-eval's defaults differ between releases (fewshot_as_multiturn).
    results = simple_evaluate(
        model=lm, tasks=tasks.names, num_fewshot=num_fewshot, limit=limit, task_manager=tasks.manager,
        log_samples=False, apply_chat_template=apply_chat_template, fewshot_as_multiturn=fewshot_as_multiturn,
        system_instruction=system_instruction,
    )
    if rank != 0 or results is None:  # lm-eval keeps its results to the process of LOCAL_RANK 0 too
        return None
    return {
        task: {
            "metrics": _metrics(values),
            "num_fewshot": results.get("n-shot", {}).get(task),
            "samples": _samples(results, task),
        }
        for task, values in results["results"].items()
    }


def _samples(results: dict[str, Any], task: str) -> int | None:
    """Documents scored for ``task``; for a group (lm-eval counts tasks only), those of its tasks together."""
    count = results.get("n-samples", {}).get(task, {}).get("effective")
    subtasks = results.get("group_subtasks", {}).get(task)
    if count is None and subtasks:
        counts = [_samples(results, subtask) for subtask in subtasks]
        count = None if None in counts else sum(counts)
    return count


def _metrics(values: dict[str, Any]) -> dict[str, float]:
    """lm-eval's ``{"acc,none": 0.5, "acc_stderr,none": 0.1, "alias": ...}`` as ``{"acc": 0.5, "acc_stderr": 0.1}``:
    numbers only (a stderr lm-eval could not compute is ``"N/A"``), the default filter's name dropped."""
    return {
        key.removesuffix(",none"): float(value)
        for key, value in values.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool) and "," in key
    }
