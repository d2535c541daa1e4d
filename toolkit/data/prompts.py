"""Prompts for online RL: each row a prompt to sample completions for, and the fields its rewards read.

A row holds a prompt (a string, or messages ending with the user's turn) and any other columns, kept as the prompt's
``fields`` (an ``answer`` for an exact-match or math reward). Unlike the training datasets, prompts are short and are
read once into memory, with the chat template applied: no cache on disk.
"""

import logging
from typing import Any

import torch.distributed as dist
from torch.utils.data import Dataset

from toolkit.data.formats import BadRowError, PromptFormat
from toolkit.data.sources import UnreadableRow, open_source
from toolkit.errors import UserError
from toolkit.tokenizers import ChatTokenizer

logger = logging.getLogger("toolkit.data")
# Bad rows named when skipped (skip_bad_rows), as the other builders do.
_EXAMPLES = 3


class PromptDataset(Dataset):
    """Prompts as items ``{"index", "prompt_tokens", "prompt", "fields", "where"}``:

    * ``prompt_tokens``: the conversation with the chat template applied, ending where the assistant's answer starts
      (:meth:`~toolkit.tokenizers.ChatTokenizer.prompt_tokens`);
    * ``prompt``: the last user message's text (what rewards are given as the prompt);
    * ``fields``: the row's other columns;
    * ``where``: the row's file and line or row (``prompts.jsonl, line 17``), which a reward's error names.

    Collate with :func:`rl_collate` (a micro-batch is a list of prompts).
    """

    def __init__(self, items: list[dict[str, Any]], *, skipped: int = 0) -> None:
        self.items = items
        self.skipped = skipped

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return dict(self.items[index])

    def longest_prompt(self) -> tuple[int, str]:
        """``(tokens, where)`` of the longest prompt: what bounds the context left for generating."""
        longest = max(self.items, key=lambda item: len(item["prompt_tokens"]))
        return len(longest["prompt_tokens"]), longest["where"]


def prompt_item(index: int, tokenizer: ChatTokenizer, messages: list[dict[str, str]], fields: dict[str, Any],
                where: str, max_prompt_tokens: int | None = None) -> dict[str, Any]:
    """One prompt's item (see :class:`PromptDataset`).

    Raises:
        BadRowError: the prompt is longer than ``max_prompt_tokens``.
    """
    tokens = tokenizer.prompt_tokens(messages)
    if max_prompt_tokens is not None and len(tokens) > max_prompt_tokens:
        raise BadRowError(f"the prompt is {len(tokens)} tokens, more than max_prompt_tokens {max_prompt_tokens}")
    return {"index": index, "prompt_tokens": tokens, "prompt": messages[-1]["content"], "fields": fields,
            "where": where}


def _check_max_prompt_tokens(max_prompt_tokens: Any) -> None:
    if max_prompt_tokens is not None and (type(max_prompt_tokens) is not int or max_prompt_tokens < 1):
        raise UserError(f"max_prompt_tokens must be a positive integer; got {max_prompt_tokens!r}")


def prompt_dataset(
    tokenizer: ChatTokenizer,
    *,
    source: str,
    format: str | None = None,
    prompt_column: str = "prompt",
    split: str | None = None,
    name: str | None = None,
    revision: str | None = None,
    system_prompt: str | None = None,
    max_prompt_tokens: int | None = None,
    skip_bad_rows: bool = False,
) -> PromptDataset:
    """Prompts from a file or the hub, for online RL (see :class:`PromptDataset` for the items).

    Args:
        tokenizer: any :class:`~toolkit.tokenizers.ChatTokenizer`; its chat template is applied.
        source: a local file, folder or glob (JSON, JSONL, CSV, Parquet), or a Hugging Face hub dataset id.
        format: ``json``, ``jsonl``, ``csv``, ``parquet`` or ``hub``; inferred from the extension by default.
        prompt_column: the column holding the prompt: a string (one user message), or OpenAI or ShareGPT messages
            ending with the user's turn. Every other column is kept as a field for the rewards.
        split, name, revision: hub dataset split (default ``train``), configuration and revision.
        system_prompt: prepended as a system message to prompts that do not start with one.
        max_prompt_tokens: a longer prompt (chat template included) is a bad row.
        skip_bad_rows: skip bad rows (counted, the first few named in a warning) instead of stopping at the first.

    Raises:
        UserError: on bad options, a missing source, an empty one, or a bad row (no prompt column, a prompt that
            is neither a string nor messages, messages not ending with a user turn, an empty prompt, a prompt over
            ``max_prompt_tokens``), naming the file and line or row.
    """
    fmt = PromptFormat(column=prompt_column, system_prompt=system_prompt)
    _check_max_prompt_tokens(max_prompt_tokens)
    data = open_source(source, format=format, split="train" if split is None else split, name=name,
                       revision=revision)
    items: list[dict[str, Any]] = []
    rows = 0
    skipped: list[str] = []
    for location, row in data.rows():
        rows += 1
        try:
            if isinstance(row, UnreadableRow):
                raise BadRowError(str(row))
            item = prompt_item(len(items), tokenizer, fmt.messages(row), fmt.fields(row), str(location), max_prompt_tokens)
        except (BadRowError, UserError) as e:
            message = f"{location}: {e}"
            if not skip_bad_rows:
                raise UserError(f"{message} (fix the row, or set skip_bad_rows: true to skip bad rows)") from None
            skipped.append(message)
            continue
        items.append(item)
    if not items:
        if rows == 0:
            raise UserError(f"the prompts have no rows: {data.why_empty()}")
        raise UserError(
            f"the prompts have no usable rows: all {rows} rows of {data.name} are bad and were skipped "
            f"(skip_bad_rows: true); the first: {skipped[0]}"
        )
    if skipped and not (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0):
        logger.warning("%s: skipped %d of %d rows as bad (skip_bad_rows: true); the first %d: %s", data.name,
                       len(skipped), rows, min(len(skipped), _EXAMPLES), "; ".join(skipped[:_EXAMPLES]))
    return PromptDataset(items, skipped=len(skipped))


def rl_collate(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A micro-batch of prompts as the list it is: the rollout pads what it generates, not the prompts."""
    return list(rows)
