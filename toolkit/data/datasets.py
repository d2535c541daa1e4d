"""Dataset builders for configs: ``dataset._component_: toolkit.data.chat_dataset`` with ``source: data.jsonl``.

Each builder reads its source once, tokenizes every row (checking it), and caches the result on disk (see
:mod:`toolkit.data.store`); the dataset then serves samples by slicing memory-mapped arrays. Samples follow the
label convention of :mod:`toolkit.data`; packed samples (``packed=True``) add ``input_pos`` (see
:mod:`toolkit.data.packing`), from which the per-document attention mask is made (by
:func:`~toolkit.data.padded_collate`, or on the device by :func:`toolkit.training.batch_attention_mask`).
"""

import copy
import hashlib
import logging
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from toolkit.data.formats import (
    ChatFormat,
    InstructFormat,
    PreferenceFormat,
    TextFormat,
    UnpairedFormat,
    check_column_map,
    template_fields,
)
from toolkit.data.labels import CROSS_ENTROPY_IGNORE_INDEX, shifted_labels
from toolkit.data.packing import STRATEGIES, pack_documents
from toolkit.data.sources import open_source
from toolkit.data.store import (
    DEFAULT_CACHE_DIR,
    BuildReport,
    Sequence,
    TaggedSequence,
    TokenStore,
    build_store,
    cached_store,
)
from toolkit.errors import UserError
from toolkit.tokenizers import TRAIN_ON, ChatTokenizer

logger = logging.getLogger("toolkit.data")

# Text the tokenizer fingerprint is computed from: scripts, digits, whitespace runs and code, so that two
# vocabularies (or chat formats) that differ anywhere common are told apart.
_PROBE_TEXT = "Hello, world! 12345 6.02e23\n\tdef f(x):  return x**2  # ünïcödé 日本語 кириллица 🙂 <|eot|>"
_PROBE_MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": _PROBE_TEXT},
    {"role": "assistant", "content": "Hi."},
    {"role": "user", "content": "Again?"},
    {"role": "assistant", "content": "Hi again."},
]


class TokenizedDataset(Dataset):
    """One ``{"tokens", "labels"}`` sample per tokenized row (labels already shifted).

    Attributes:
        store: the tokenized samples.
        report: what the build pass found (rows read, skipped, truncated).
        cache_hit: whether the store came from the cache.
    """

    def __init__(self, store: TokenStore, *, cache_hit: bool) -> None:
        self.store = store
        self.report = store.report
        self.cache_hit = cache_hit

    def __len__(self) -> int:
        return len(self.store)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        tokens, mask = self.store.sample(index)
        return {"tokens": tokens, "labels": shifted_labels(tokens, mask)}


class PackedDataset(Dataset):
    """Samples packed into sequences of at most ``max_seq_len`` tokens, documents kept apart.

    Each item is ``{"tokens", "labels", "input_pos"}``: the documents end to end, each with its own shifted
    labels (so a document's last label is the ignore index) and positions restarting at 0. Collate with
    :func:`~toolkit.data.padded_collate`, which adds the block-diagonal attention mask.

    Args:
        store: the tokenized documents, none longer than ``max_seq_len``.
        max_seq_len: capacity of a pack.
        strategy: see :func:`~toolkit.data.packing.pack_documents`.
        cache_hit: whether the store came from the cache.
    """

    def __init__(self, store: TokenStore, *, max_seq_len: int, strategy: str, cache_hit: bool) -> None:
        self.store = store
        self.report = store.report
        self.cache_hit = cache_hit
        self.max_seq_len = max_seq_len

        def plan() -> dict[str, torch.Tensor]:
            packs = pack_documents(store.lengths().tolist(), max_seq_len, strategy=strategy)
            return {
                "docs": torch.tensor([doc for pack in packs for doc in pack], dtype=torch.int64),
                "offsets": torch.tensor([0] + [len(pack) for pack in packs], dtype=torch.int64).cumsum(0),
            }

        # Kept next to the store; its key already covers max_seq_len, so the strategy names the plan.
        arrays = store.cached_arrays(f"pack-{strategy}", plan)
        self.docs, self.pack_offsets = arrays["docs"], arrays["offsets"]

    def __len__(self) -> int:
        return self.pack_offsets.numel() - 1

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        tokens: list[int] = []
        labels: list[int] = []
        input_pos: list[int] = []
        for doc in self.docs[self.pack_offsets[index] : self.pack_offsets[index + 1]].tolist():
            doc_tokens, mask = self.store.sample(doc)
            tokens += doc_tokens
            labels += shifted_labels(doc_tokens, mask)
            input_pos += range(len(doc_tokens))
        return {"tokens": tokens, "labels": labels, "input_pos": input_pos}

    def num_tokens(self) -> int:
        """Tokens in all packs (for packing efficiency: divide by ``len(self) * max_seq_len``)."""
        return int(self.store.offsets[-1])


class PreferenceDataset(Dataset):
    """Preference pairs: ``{"chosen_tokens", "chosen_labels", "rejected_tokens", "rejected_labels"}``.

    Collate with :func:`~toolkit.data.preference_collate`.
    """

    def __init__(self, store: TokenStore, *, cache_hit: bool) -> None:
        self.store = store
        self.report = store.report
        self.cache_hit = cache_hit

    def __len__(self) -> int:
        return len(self.store) // 2

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        sample = {}
        # The store holds each pair as two consecutive sequences.
        for offset, name in enumerate(("chosen", "rejected")):
            tokens, mask = self.store.sample(2 * index + offset)
            sample[f"{name}_tokens"] = tokens
            sample[f"{name}_labels"] = shifted_labels(tokens, mask)
        return sample


class UnpairedDataset(Dataset):
    """Answers judged one at a time, desirable or not, for KTO: ``{"completion_tokens", "completion_labels",
    "kl_tokens", "kl_labels", "desirable"}``.

    ``completion_*`` is the sample itself (labels already shifted, only its answer trained on); ``kl_*`` is its
    prompt followed by another sample's answer, on which KTO estimates how far the policy has moved from its
    reference (the KL term of its reference point). The other sample is the next one on a cycle through all of
    them in an order drawn from ``seed``: never the sample itself, each answer used once. It is fixed by the seed,
    not drawn per batch, so a global batch's estimate is the same whatever its split into ranks and micro-steps,
    and the reference's scores of these sequences can be computed once (``precompute_reference``).

    Args:
        samples: ``{"tokens", "labels"}`` items, each a prompt and its answer (the trained tokens, at the end).
        desirable: per sample, whether its answer is desirable.
        max_seq_len: the longest sequence; a prompt with another's answer is cut to it.
        seed: draws the cycle.

    Raises:
        UserError: fewer than two samples (no other answer to pair a prompt with).
    """

    def __init__(self, samples: Dataset, desirable, *, max_seq_len: int | None, seed: int = 0) -> None:
        if len(samples) < 2:
            raise UserError(f"kto needs at least two rows (each prompt is also scored with another row's answer); "
                            f"got {len(samples)}")
        self.samples, self.max_seq_len = samples, max_seq_len
        self.desirable = torch.as_tensor(desirable, dtype=torch.bool)
        # Kept where the caller looks for the tokenized data (preference.reference_logps_file) and the build report.
        self.store, self.report = getattr(samples, "store", None), getattr(samples, "report", None)
        self.cache_hit = getattr(samples, "cache_hit", False)
        order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(seed))
        self.partner = torch.empty_like(order)
        self.partner[order] = order.roll(-1)

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def num_desirable(self) -> int:
        return int(self.desirable.sum())

    def __getitem__(self, index: int) -> dict:
        own, other = self.samples[index], self.samples[int(self.partner[index])]
        prompt = _answer_start(own["labels"])
        start = _answer_start(other["labels"])
        # Positions before the prompt's end predict prompt tokens (not trained); from its last one on, the
        # other's labels: labels[t] is the target of position t (see toolkit.data).
        tokens = own["tokens"][:prompt] + other["tokens"][start:]
        labels = [CROSS_ENTROPY_IGNORE_INDEX] * (prompt - 1) + other["labels"][start - 1:]
        if self.max_seq_len is not None and len(tokens) > self.max_seq_len:
            tokens = tokens[: self.max_seq_len]
            labels = labels[: self.max_seq_len - 1] + [CROSS_ENTROPY_IGNORE_INDEX]
        return {"completion_tokens": own["tokens"], "completion_labels": own["labels"], "kl_tokens": tokens,
                "kl_labels": labels, "desirable": bool(self.desirable[index])}


def _answer_start(labels: list[int]) -> int:
    """The position of a sample's first trained token (its answer's start): one after the first label."""
    return next(i for i, label in enumerate(labels) if label != CROSS_ENTROPY_IGNORE_INDEX) + 1


def instruct_dataset(
    tokenizer: ChatTokenizer,
    *,
    source: str,
    format: str | None = None,
    column_map: dict[str, str] | None = None,
    prompt_template: str = "{input}",
    system_prompt: str | None = None,
    train_on: str = "assistant",
    max_seq_len: int | None = None,
    truncation: bool = True,
    packed: bool = False,
    packing_strategy: str = "best_fit",
    skip_bad_rows: bool = False,
    split: str = "train",
    name: str | None = None,
    revision: str | None = None,
    cache_dir: str | None = DEFAULT_CACHE_DIR,
) -> Dataset:
    """Prompt/response rows as ``[system?, user, assistant]`` conversations.

    Args:
        tokenizer: any :class:`~toolkit.tokenizers.ChatTokenizer`.
        source: a local file, folder or glob (JSON, JSONL, CSV, Parquet), or a Hugging Face hub dataset id.
        format: ``json``, ``jsonl``, ``csv``, ``parquet`` or ``hub``; inferred from the extension by default.
        column_map: our column names (``input``, ``output``, optional ``system``, and template fields) to the
            file's, e.g. ``{"input": "question", "output": "answer"}``.
        prompt_template: the user turn, a ``str.format`` template over columns, e.g.
            ``"{instruction}\\n\\n{input}"``; the default is the ``input`` column as is.
        system_prompt: a system message for every sample (unless ``column_map`` maps a ``system`` column).
        train_on: which tokens are targets: ``assistant``, ``last_turn`` or ``all``.
        max_seq_len: longest sample; defaults to the tokenizer's ``max_seq_len``.
        truncation: cut longer samples to ``max_seq_len``; if False, a longer sample is a bad row.
        packed: pack samples into sequences of ``max_seq_len`` (see :class:`PackedDataset`).
        packing_strategy: ``best_fit`` or ``in_order`` (see :func:`~toolkit.data.packing.pack_documents`).
        skip_bad_rows: skip malformed rows (counted and reported) instead of stopping at the first.
        split: hub split.
        name: hub configuration name.
        revision: hub revision.
        cache_dir: where tokenized datasets are cached; ``None`` tokenizes in memory on every run.

    Raises:
        UserError: on bad options, a missing source, or a bad row (naming file and line or row).
    """
    fields = template_fields(prompt_template)
    columns = check_column_map(column_map, {"input", "output", "system", *fields}, builder="instruct_dataset")
    fmt = InstructFormat(column_map=columns, prompt_template=prompt_template, system_prompt=system_prompt)
    _check_train_on(train_on)

    return _build(
        tokenizer, "instruct", {"format": repr(fmt), "train_on": train_on}, _messages_encoder(fmt, train_on),
        source=source, format=format, split=split, name=name, revision=revision, max_seq_len=max_seq_len,
        truncation=truncation, packed=packed, packing_strategy=packing_strategy, skip_bad_rows=skip_bad_rows,
        cache_dir=cache_dir,
    )


def chat_dataset(
    tokenizer: ChatTokenizer,
    *,
    source: str,
    format: str | None = None,
    column_map: dict[str, str] | None = None,
    system_prompt: str | None = None,
    train_on: str = "assistant",
    max_seq_len: int | None = None,
    truncation: bool = True,
    packed: bool = False,
    packing_strategy: str = "best_fit",
    skip_bad_rows: bool = False,
    split: str = "train",
    name: str | None = None,
    revision: str | None = None,
    cache_dir: str | None = DEFAULT_CACHE_DIR,
) -> Dataset:
    """Multi-turn conversations: OpenAI ``messages`` (``role``/``content``) or ShareGPT ``conversations``
    (``from``/``value`` with ``human``/``gpt`` roles).

    Args:
        tokenizer: any :class:`~toolkit.tokenizers.ChatTokenizer`.
        source: a local file, folder or glob (JSON, JSONL, Parquet), or a Hugging Face hub dataset id.
        format: ``json``, ``jsonl``, ``csv``, ``parquet`` or ``hub``; inferred from the extension by default.
        column_map: ``{"messages": <column>}``; by default ``messages``, else ``conversations``.
        system_prompt: prepended to conversations that do not start with a system message.
        train_on: which tokens are targets: ``assistant``, ``last_turn`` or ``all``.
        max_seq_len, truncation, packed, packing_strategy, skip_bad_rows, split, name, revision, cache_dir:
            as in :func:`instruct_dataset`.

    Raises:
        UserError: on bad options, a missing source, or a bad row (naming file and line or row).
    """
    columns = check_column_map(column_map, {"messages"}, builder="chat_dataset")
    fmt = ChatFormat(column=columns.get("messages"), system_prompt=system_prompt)
    _check_train_on(train_on)

    return _build(
        tokenizer, "chat", {"format": repr(fmt), "train_on": train_on}, _messages_encoder(fmt, train_on),
        source=source, format=format, split=split, name=name, revision=revision, max_seq_len=max_seq_len,
        truncation=truncation, packed=packed, packing_strategy=packing_strategy, skip_bad_rows=skip_bad_rows,
        cache_dir=cache_dir,
    )


def text_completion_dataset(
    tokenizer: ChatTokenizer,
    *,
    source: str,
    format: str | None = None,
    column_map: dict[str, str] | None = None,
    max_seq_len: int | None = None,
    truncation: bool = True,
    packed: bool = False,
    packing_strategy: str = "best_fit",
    skip_bad_rows: bool = False,
    split: str = "train",
    name: str | None = None,
    revision: str | None = None,
    cache_dir: str | None = DEFAULT_CACHE_DIR,
) -> Dataset:
    """Plain documents, every token a target (continued pre-training).

    Args:
        tokenizer: any :class:`~toolkit.tokenizers.ChatTokenizer`.
        source: a ``.txt`` file (a document per line), a folder of ``.txt`` files (a document per file), a
            JSON/JSONL/CSV/Parquet file or folder with a text column, or a Hugging Face hub dataset id.
        format: ``text`` (a document per line), ``text_files`` (per file), ``json``, ``jsonl``, ``csv``,
            ``parquet`` or ``hub``; inferred by default.
        column_map: ``{"text": <column>}``; by default ``text``.
        max_seq_len, truncation, packed, packing_strategy, skip_bad_rows, split, name, revision, cache_dir:
            as in :func:`instruct_dataset`.

    Raises:
        UserError: on bad options, a missing source, or a bad row (naming file and line or row).
    """
    columns = check_column_map(column_map, {"text"}, builder="text_completion_dataset")
    fmt = TextFormat(column=columns.get("text", "text"))

    def encode(tok: ChatTokenizer) -> Callable[[Any], list[Sequence]]:
        def one(row: Any) -> list[Sequence]:
            tokens = tok.encode(fmt.text(row), add_bos=True, add_eos=True)
            return [(tokens, [True] * len(tokens))]

        return one

    return _build(
        tokenizer, "text_completion", {"format": repr(fmt)}, encode,
        source=source, format=format, split=split, name=name, revision=revision, max_seq_len=max_seq_len,
        truncation=truncation, packed=packed, packing_strategy=packing_strategy, skip_bad_rows=skip_bad_rows,
        cache_dir=cache_dir,
    )


def preference_dataset(
    tokenizer: ChatTokenizer,
    *,
    source: str,
    format: str | None = None,
    column_map: dict[str, str] | None = None,
    system_prompt: str | None = None,
    train_on: str = "last_turn",
    max_seq_len: int | None = None,
    truncation: bool = True,
    skip_bad_rows: bool = False,
    split: str = "train",
    name: str | None = None,
    revision: str | None = None,
    cache_dir: str | None = DEFAULT_CACHE_DIR,
) -> Dataset:
    """Chosen/rejected pairs, both tokenized (see :class:`PreferenceDataset`), for preference tuning.

    ``chosen`` and ``rejected`` are response strings following a ``prompt`` column (a string or messages), or
    whole conversations as lists of messages.

    Args:
        tokenizer: any :class:`~toolkit.tokenizers.ChatTokenizer`.
        source: a local file, folder or glob (JSON, JSONL, CSV, Parquet), or a Hugging Face hub dataset id.
        format: ``json``, ``jsonl``, ``csv``, ``parquet`` or ``hub``; inferred from the extension by default.
        column_map: our names (``prompt``, ``chosen``, ``rejected``) to the file's.
        system_prompt: prepended to conversations that do not start with a system message.
        train_on: which tokens are scored: ``last_turn`` (the default: the answers the pair compares, as the
            preference losses are defined; earlier turns of a conversation are context), ``assistant`` or ``all``.
        max_seq_len, truncation, skip_bad_rows, split, name, revision, cache_dir: as in :func:`instruct_dataset`;
            a row is bad if either of its conversations is.

    Raises:
        UserError: on bad options, a missing source, or a bad row (naming file and line or row).
    """
    columns = check_column_map(column_map, {"prompt", "chosen", "rejected"}, builder="preference_dataset")
    fmt = PreferenceFormat(column_map=columns, system_prompt=system_prompt)
    _check_train_on(train_on)

    def encode(tok: ChatTokenizer) -> Callable[[Any], list[Sequence]]:
        return lambda row: [
            tok.tokenize_messages(messages, add_eos=True, train_on=train_on) for messages in fmt.pair(row)
        ]

    return _build(
        tokenizer, "preference", {"format": repr(fmt), "train_on": train_on}, encode,
        source=source, format=format, split=split, name=name, revision=revision, max_seq_len=max_seq_len,
        truncation=truncation, packed=False, packing_strategy="best_fit", skip_bad_rows=skip_bad_rows,
        cache_dir=cache_dir,
    )


def kto_dataset(
    tokenizer: ChatTokenizer,
    *,
    source: str,
    format: str | None = None,
    column_map: dict[str, str] | None = None,
    system_prompt: str | None = None,
    max_seq_len: int | None = None,
    truncation: bool = True,
    skip_bad_rows: bool = False,
    split: str = "train",
    name: str | None = None,
    revision: str | None = None,
    cache_dir: str | None = DEFAULT_CACHE_DIR,
    kl_seed: int = 0,
) -> UnpairedDataset:
    """Answers judged one at a time, desirable or not, for KTO (``preference_loss: kto``; see
    :class:`UnpairedDataset`).

    A row is a ``prompt`` with a ``completion`` and its ``label`` (true: desirable; TRL's unpaired layout), or a
    preference pair (``prompt``, ``chosen``, ``rejected``, as :func:`preference_dataset` reads them), which gives
    two rows, the chosen answer desirable and the rejected one not. Only the answer (the conversation's last turn)
    is trained on.

    Args:
        tokenizer: any :class:`~toolkit.tokenizers.ChatTokenizer`.
        source, format, split, name, revision, max_seq_len, truncation, skip_bad_rows, cache_dir: as in
            :func:`instruct_dataset`.
        column_map: our names (``prompt``, ``completion``, ``label``, ``chosen``, ``rejected``) to the file's.
        system_prompt: prepended to conversations that do not start with a system message.
        kl_seed: draws which other answer each prompt is scored with for the KL estimate.

    Raises:
        UserError: on bad options, a missing source, a bad row (naming file and line or row: a missing or
            non-boolean ``label`` too), or fewer than two rows.
    """
    columns = check_column_map(column_map, {"prompt", "completion", "label", "chosen", "rejected"},
                               builder="kto_dataset")
    fmt = UnpairedFormat(column_map=columns, system_prompt=system_prompt)

    def encode(tok: ChatTokenizer) -> Callable[[Any], list[TaggedSequence]]:
        return lambda row: [
            (*tok.tokenize_messages(messages, add_eos=True, train_on="last_turn"), int(desirable))
            for messages, desirable in fmt.rows(row)
        ]

    samples = _build(
        tokenizer, "kto", {"format": repr(fmt)}, encode, source=source, format=format, split=split, name=name,
        revision=revision, max_seq_len=max_seq_len, truncation=truncation, packed=False,
        packing_strategy="best_fit", skip_bad_rows=skip_bad_rows, cache_dir=cache_dir, tagged=True,
    )
    limit = max_seq_len if max_seq_len is not None else tokenizer.max_seq_len
    return UnpairedDataset(samples, samples.store.tags.bool(), max_seq_len=limit, seed=kl_seed)


def _messages_encoder(
    fmt: InstructFormat | ChatFormat, train_on: str
) -> Callable[[ChatTokenizer], Callable[[Any], list[Sequence]]]:
    """For formats that turn a row into messages: tokenizes them with the train mask ``train_on`` asks for."""

    def encode(tok: ChatTokenizer) -> Callable[[Any], list[Sequence]]:
        return lambda row: [tok.tokenize_messages(fmt.messages(row), add_eos=True, train_on=train_on)]

    return encode


def _check_train_on(train_on: str) -> None:
    if train_on not in TRAIN_ON:
        raise UserError(f"train_on must be one of {', '.join(TRAIN_ON)}; got {train_on!r}")


def _build(
    tokenizer: ChatTokenizer,
    kind: str,
    options: dict[str, Any],
    encoder: Callable[[ChatTokenizer], Callable[[Any], list[Sequence]]],
    *,
    source: str,
    format: str | None,
    split: str,
    name: str | None,
    revision: str | None,
    max_seq_len: int | None,
    truncation: bool,
    packed: bool,
    packing_strategy: str,
    skip_bad_rows: bool,
    cache_dir: str | None,
    tagged: bool = False,
) -> Dataset:
    """Shared by the builders: open the source, tokenize or load from cache, report, wrap. ``tagged``: the
    encoder's sequences carry a tag each (see :func:`~toolkit.data.store.build_store`)."""
    if max_seq_len is None:
        max_seq_len = tokenizer.max_seq_len
    if max_seq_len is not None and (type(max_seq_len) is not int or max_seq_len < 1):  # bool is an int too
        raise UserError(f"max_seq_len must be a positive integer; got {max_seq_len!r}")
    if packed and max_seq_len is None:
        raise UserError("packed: true needs a max_seq_len (on the dataset or the tokenizer)")
    if packing_strategy not in STRATEGIES:
        raise UserError(f"packing_strategy must be one of {', '.join(STRATEGIES)}; got {packing_strategy!r}")

    data = open_source(source, format=format, split=split, name=name, revision=revision)
    # Length is the dataset's business: it needs a sample's full length to decide between truncating and
    # reporting the row, which a tokenizer that truncates silently would hide.
    tok = copy.copy(tokenizer)
    tok.max_seq_len = None
    encode = encoder(tok)
    key_inputs = {
        "builder": kind,
        "options": options,
        "source": data.fingerprint,
        "tokenizer": tokenizer_fingerprint(tok),
        "max_seq_len": max_seq_len,
        "truncation": truncation,
        "skip_bad_rows": skip_bad_rows,
    }

    def build(directory: Path | None) -> TokenStore:
        logger.info("tokenizing %s", data.name)
        return build_store(
            data, encode, max_seq_len=max_seq_len, truncation=truncation, skip_bad_rows=skip_bad_rows,
            directory=directory, tagged=tagged,
        )

    store, hit = cached_store(key_inputs, build, cache_dir=cache_dir)
    _log_report(data.name, store.report, max_seq_len=max_seq_len)
    if packed:
        assert max_seq_len is not None
        return PackedDataset(store, max_seq_len=max_seq_len, strategy=packing_strategy, cache_hit=hit)
    if kind == "preference":
        return PreferenceDataset(store, cache_hit=hit)
    return TokenizedDataset(store, cache_hit=hit)


def tokenizer_fingerprint(tokenizer: ChatTokenizer) -> dict[str, Any]:
    """What identifies a tokenizer's output: its class, special ids and a hash of its output on probe text.

    The probe goes through :meth:`encode` and, for every ``train_on``, :meth:`tokenize_messages`, so a change of
    vocabulary, special tokens or chat format changes the fingerprint.
    """
    outputs = [tokenizer.encode(_PROBE_TEXT, add_bos=True, add_eos=True)]
    outputs += [tokenizer.tokenize_messages(_PROBE_MESSAGES, add_eos=True, train_on=t) for t in TRAIN_ON]
    return {
        "class": f"{type(tokenizer).__module__}.{type(tokenizer).__qualname__}",
        "vocab_size": tokenizer.vocab_size,
        "special_ids": [tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id, list(tokenizer.stop_tokens)],
        "probe": hashlib.sha256(repr(outputs).encode()).hexdigest(),
    }


def _log_report(name: str, report: BuildReport, *, max_seq_len: int | None) -> None:
    # One process per node would do, but every rank builds or loads; rank 0 speaks for all of them.
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    if report.skipped:
        logger.warning(
            "%s: skipped %d of %d rows as bad (skip_bad_rows: true); the first %d: %s",
            name, report.skipped, report.rows, len(report.skipped_examples), "; ".join(report.skipped_examples),
        )
    if report.truncated:
        logger.warning("%s: cut %d samples to max_seq_len %s (truncation: true)", name, report.truncated, max_seq_len)
