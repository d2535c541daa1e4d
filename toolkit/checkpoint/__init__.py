"""Everything a run reads and writes as weights, and the folders it writes them in.

- Step checkpoints: :mod:`~toolkit.checkpoint.step_files` (the folder's layout and which checkpoint to resume),
  :mod:`~toolkit.checkpoint.step_writer` (every rank writes its shards; a checkpoint is visible once complete) and
  :mod:`~toolkit.checkpoint.step_reader` (everything checked before anything is restored).
- Formats: Hugging Face safetensors (:mod:`~toolkit.checkpoint.hf`, with the file plan and streaming readers of
  :mod:`~toolkit.checkpoint.safetensors_files`), Meta's consolidated files (:mod:`~toolkit.checkpoint.meta`) and
  PEFT adapters (:mod:`~toolkit.checkpoint.peft`, with MoE experts and fused projections).
- Export and merge (:mod:`~toolkit.checkpoint.export`: a step checkpoint to Hugging Face files; ``tune merge``
  through :func:`~toolkit.checkpoint.peft.merge_adapter_into_checkpoint`), reading pickles without running code
  (:mod:`~toolkit.checkpoint.safe_load`), and what a run may write or clear (:mod:`~toolkit.checkpoint.output_dir`).

It sits above :mod:`toolkit.training` (it saves what the step trains) and below the objectives and recipes.
"""

from toolkit.checkpoint.hf import HFCheckpointer, gather_full_state_dict, load_model_family
from toolkit.checkpoint.meta import MetaCheckpointer
from toolkit.checkpoint.output_dir import claim_output_dir, prepare_output_dir, start_run
from toolkit.checkpoint.step_files import TrainingState, find_resume_checkpoint, latest_checkpoint
from toolkit.checkpoint.step_writer import StepCheckpointer

__all__ = [
    "HFCheckpointer",
    "MetaCheckpointer",
    "StepCheckpointer",
    "TrainingState",
    "claim_output_dir",
    "find_resume_checkpoint",
    "gather_full_state_dict",
    "latest_checkpoint",
    "load_model_family",
    "prepare_output_dir",
    "start_run",
]
