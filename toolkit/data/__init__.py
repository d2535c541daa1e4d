"""Datasets, collation and sampling.

Label convention (the whole project relies on it):

* A sample is ``{"tokens": list[int], "labels": list[int]}`` with ``len(labels) == len(tokens)``.
* Labels are already shifted: ``labels[i]`` is the target of position i, that is ``tokens[i + 1]`` when token
  ``i + 1`` is trained on, else :data:`CROSS_ENTROPY_IGNORE_INDEX` (-100). The last label is always -100.
* Hence the loss needs no slicing::

      F.cross_entropy(logits.view(-1, V), labels.view(-1), ignore_index=-100, reduction="sum")

  and the number of non-ignored labels is the token count to normalize by across micro batches and ranks.
* Padding (see :func:`padded_collate`) fills tokens with the tokenizer's ``pad_id`` and labels with -100.

Sampling: :class:`GlobalBatchSampler` fixes the global sample order by seed and epoch, independent of the number
of processes, and resumes mid-epoch from its ``state_dict``.
"""

from toolkit.data.chat import ChatDataset
from toolkit.data.collate import padded_collate
from toolkit.data.demo import demo_dataset, demo_tasks
from toolkit.data.labels import CROSS_ENTROPY_IGNORE_INDEX, shifted_labels
from toolkit.data.sampler import GlobalBatchSampler

__all__ = [
    "CROSS_ENTROPY_IGNORE_INDEX",
    "ChatDataset",
    "GlobalBatchSampler",
    "demo_dataset",
    "demo_tasks",
    "padded_collate",
    "shifted_labels",
]
