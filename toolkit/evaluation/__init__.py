"""Evaluating a model with external harnesses.

``lm-evaluation-harness`` (the ``eval`` extra: ``pip install "tunekit[eval]"``) is imported only when its tasks are
asked for; without it, :func:`load_lm_eval_tasks` says how to install it.
"""

from toolkit.evaluation.chat_template import ChatTemplate
from toolkit.evaluation.lm_eval_harness import LMEvalTasks, check_chat_settings, load_lm_eval_tasks, run_lm_eval

__all__ = ["ChatTemplate", "LMEvalTasks", "check_chat_settings", "load_lm_eval_tasks", "run_lm_eval"]
