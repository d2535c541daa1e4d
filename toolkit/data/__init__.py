"""Datasets, collation and sampling.

Label convention (the whole project relies on it):

* A sample is ``{"tokens": list[int], "labels": list[int]}`` with ``len(labels) == len(tokens)``.
* Labels are already shifted: ``labels[i]`` is the target of position i, that is ``tokens[i + 1]`` when token
  ``i + 1`` is trained on, else :data:`CROSS_ENTROPY_IGNORE_INDEX` (-100). The last label is always -100.
* Hence the loss needs no slicing::

      F.cross_entropy(logits.view(-1, V), labels.view(-1), ignore_index=-100, reduction="sum")

  and the number of non-ignored labels is the token count to normalize by across micro batches and ranks.
* Padding (see :func:`padded_collate`) fills tokens with the tokenizer's ``pad_id`` and labels with -100.

Datasets from files or the hub: :func:`instruct_dataset`, :func:`chat_dataset`, :func:`text_completion_dataset`
:func:`preference_dataset` and :func:`kto_dataset`, each ``(tokenizer, *, source, ...)``. They tokenize the source once, checking
every row (a bad one stops the build naming file and line, or is skipped with ``skip_bad_rows``), cache the result
on disk keyed by a fingerprint of source, tokenizer and options, and with ``packed=True`` pack documents into
sequences of ``max_seq_len`` whose ``input_pos`` restart per document; :func:`padded_collate` turns those into
the block-diagonal causal ``mask`` the model takes, so no attention or loss crosses a document boundary.

Prompts for online RL: :func:`prompt_dataset` (and :func:`demo_prompt_dataset`) read every row once into memory
with the chat template applied, keeping the row's other columns as the fields rewards read; :func:`rl_collate`
leaves a micro-batch a list of prompts.

Sampling: :class:`GlobalBatchSampler` fixes the global sample order by seed and epoch, independent of the number
of processes, and resumes mid-epoch from its ``state_dict``.
"""

from toolkit.data.chat import ChatDataset
from toolkit.data.collate import kto_collate, padded_collate, preference_collate
from toolkit.data.datasets import (
    PackedDataset,
    PreferenceDataset,
    TokenizedDataset,
    UnpairedDataset,
    chat_dataset,
    instruct_dataset,
    kto_dataset,
    preference_dataset,
    text_completion_dataset,
)
from toolkit.data.demo import (
    demo_data_warning,
    demo_dataset,
    demo_preference_dataset,
    demo_prompt_dataset,
    demo_tasks,
    demo_unpaired_dataset,
)
from toolkit.data.labels import CROSS_ENTROPY_IGNORE_INDEX, shifted_labels
from toolkit.data.packing import document_ids, pack_documents, packed_attention_mask
from toolkit.data.prompts import PromptDataset, prompt_dataset, rl_collate
from toolkit.data.sampler import GlobalBatchSampler

__all__ = [
    "CROSS_ENTROPY_IGNORE_INDEX",
    "ChatDataset",
    "GlobalBatchSampler",
    "PackedDataset",
    "PreferenceDataset",
    "PromptDataset",
    "TokenizedDataset",
    "UnpairedDataset",
    "chat_dataset",
    "demo_data_warning",
    "demo_dataset",
    "demo_preference_dataset",
    "demo_prompt_dataset",
    "demo_tasks",
    "demo_unpaired_dataset",
    "document_ids",
    "instruct_dataset",
    "kto_collate",
    "kto_dataset",
    "pack_documents",
    "packed_attention_mask",
    "padded_collate",
    "preference_collate",
    "preference_dataset",
    "prompt_dataset",
    "rl_collate",
    "shifted_labels",
    "text_completion_dataset",
]
