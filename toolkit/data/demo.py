"""Synthetic instruction tasks that a tiny byte-level model learns within minutes on a CPU.

Each prompt names its task, e.g. ``"reverse: lamp"`` -> ``"pmal"``; as preference pairs
(:func:`demo_preference_dataset`), the right answer is chosen and another task's answer on the same word rejected.
Words are random lowercase strings (4 letters by default). Whether a word belongs to ``train`` or ``heldout`` is a fixed property of the word (a hash of it), the
same for every seed and task, so a held-out prompt never shares its word with any training prompt.
"""

import hashlib
import random
import string
from typing import Any, Callable

from torch.utils.data import Dataset

from toolkit.data.chat import ChatDataset
from toolkit.data.datasets import UnpairedDataset
from toolkit.data.formats import PromptFormat
from toolkit.data.prompts import PromptDataset, prompt_item
from toolkit.errors import UserError
from toolkit.tokenizers import ChatTokenizer

# Each family maps a word to its answer. All are per-character or copy operations, which a few attention
# layers pick up quickly; arithmetic was left out because a tiny model needs far longer to generalize it.
TASKS: dict[str, Callable[[str], str]] = {
    "reverse": lambda word: word[::-1],
    "upper": str.upper,
    "sort": lambda word: "".join(sorted(word)),
    "repeat": lambda word: f"{word} {word}",
}
SPLITS: tuple[str, ...] = ("train", "heldout")
# Percent of all words that are held out.
_HELDOUT_PERCENT = 10
# Words of one length put each answer character at a fixed distance from its source character, which a tiny
# model learns in a few hundred steps; mixed lengths need an induction-style lookup that takes thousands.
DEFAULT_WORD_LEN = (4, 4)


def word_split(word: str) -> str:
    """The split a word belongs to, decided by a stable hash (not Python's per-process salted ``hash``)."""
    bucket = int.from_bytes(hashlib.sha256(word.encode("utf-8")).digest()[:8], "little") % 100
    return "heldout" if bucket < _HELDOUT_PERCENT else "train"


def demo_tasks(
    *,
    split: str = "train",
    num_samples: int = 1000,
    seed: int = 0,
    tasks: list[str] | None = None,
    word_len: tuple[int, int] = DEFAULT_WORD_LEN,
    label_noise: float = 0.0,
) -> list[dict]:
    """Generates samples ``{"task", "prompt", "answer"}``, deterministically from ``(split, seed, tasks)``.

    Tasks take turns (sample i has task ``tasks[i % len(tasks)]``), so every family is equally represented, and
    a shorter list is a prefix of a longer one with the same arguments.

    Args:
        split: ``"train"`` or ``"heldout"``; disjoint in words for any pair of seeds.
        num_samples: how many samples.
        seed: seeds the word generator.
        tasks: task families to use, default all of ``reverse``, ``upper``, ``sort``, ``repeat``.
        word_len: shortest and longest word, in letters.
        label_noise: the share of samples, in [0, 1), whose answer is wrong: another task's answer on the same word
            (drawn apart from the words, so the prompts are those of the clean set). Noisy labels are what a
            teacher that knows the tasks can correct (the distillation demo).

    Raises:
        UserError: on an unknown split or task, an empty task list, or a ``label_noise`` outside [0, 1).
    """
    if split not in SPLITS:
        raise UserError(f"demo split must be one of {', '.join(SPLITS)}; got {split!r}")
    tasks = list(TASKS) if tasks is None else list(tasks)
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise UserError(f"demo tasks must be a non-empty list drawn from {', '.join(TASKS)}; got {tasks!r}")
    min_len, max_len = word_len
    if not 1 <= min_len <= max_len:
        raise UserError(f"demo word_len must be [min, max] with 1 <= min <= max; got {list(word_len)!r}")
    if num_samples < 0:
        raise UserError(f"demo num_samples must be >= 0; got {num_samples}")
    if not 0 <= label_noise < 1:
        raise UserError(f"demo label_noise must be in [0, 1); got {label_noise}")

    # A string seed goes through SHA-512 inside `random`, so it is stable across processes and Python runs;
    # the split is part of it so that the two splits are not filtered views of one word stream.
    rng = random.Random(f"tunekit-demo:{seed}:{split}")
    noise = random.Random(f"tunekit-demo-noise:{seed}:{split}")
    samples = []
    for i in range(num_samples):
        task = tasks[i % len(tasks)]
        # Rejection keeps the split a property of the word alone; held-out words are 1 in 10, so ~10 draws.
        while True:
            word = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(min_len, max_len)))
            if word_split(word) == split:
                break
        answer = TASKS[task](word)
        if label_noise and noise.random() < label_noise:
            wrong = [other(word) for name, other in TASKS.items() if other(word) != answer]
            answer = noise.choice(wrong) if wrong else answer
        samples.append({"task": task, "prompt": f"{task}: {word}", "answer": answer})
    return samples


def demo_dataset(
    tokenizer: ChatTokenizer,
    *,
    split: str = "train",
    num_samples: int = 20000,
    seed: int = 0,
    tasks: list[str] | None = None,
    word_len: tuple[int, int] = DEFAULT_WORD_LEN,
    train_on: str = "assistant",
    label_noise: float = 0.0,
) -> Dataset:
    """The demo tasks as a map-style dataset of ``{"tokens", "labels"}`` (labels already shifted).

    Each sample is the conversation ``[user: prompt, assistant: answer]``; see :func:`demo_tasks` for the
    arguments and :mod:`toolkit.data` for the label convention.

    Args:
        tokenizer: any :class:`~toolkit.tokenizers.ChatTokenizer`.
        split: ``"train"`` or ``"heldout"``.
        num_samples: how many samples.
        seed: seeds the word generator.
        tasks: task families, default all.
        word_len: shortest and longest word, in letters.
        train_on: which tokens are targets: ``"assistant"``, ``"last_turn"`` or ``"all"``.
        label_noise: the share of samples whose answer is another task's (see :func:`demo_tasks`).
    """
    samples = demo_tasks(split=split, num_samples=num_samples, seed=seed, tasks=tasks, word_len=word_len,
                         label_noise=label_noise)
    return ChatDataset([_exchange(s["prompt"], s["answer"]) for s in samples], tokenizer, train_on=train_on)


def _exchange(prompt: str, answer: str) -> list[dict[str, str]]:
    """The conversation of one demo sample: the prompt, and an answer to it."""
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]


class _Pairs(Dataset):
    """Two conversation datasets of equal length as preference pairs: ``{"chosen_tokens", "chosen_labels",
    "rejected_tokens", "rejected_labels"}`` (what :func:`~toolkit.data.preference_collate` takes)."""

    def __init__(self, chosen: ChatDataset, rejected: ChatDataset) -> None:
        self.chosen, self.rejected = chosen, rejected

    def __len__(self) -> int:
        return len(self.chosen)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        chosen, rejected = self.chosen[index], self.rejected[index]
        return {"chosen_tokens": chosen["tokens"], "chosen_labels": chosen["labels"],
                "rejected_tokens": rejected["tokens"], "rejected_labels": rejected["labels"]}


def demo_preference_dataset(
    tokenizer: ChatTokenizer,
    *,
    split: str = "train",
    num_samples: int = 20000,
    seed: int = 0,
    tasks: list[str] | None = None,
    word_len: tuple[int, int] = DEFAULT_WORD_LEN,
    train_on: str = "last_turn",
) -> Dataset:
    """The demo tasks as preference pairs: the prompt's right answer chosen, and rejected the answer of another task
    on the same word (``"reverse: lamp"``: ``"pmal"`` over ``"LAMP"``, say), one that differs from the right one,
    drawn from ``(split, seed)``. A model that prefers the chosen answers has learned to read the task's name.

    Arguments as :func:`demo_dataset`'s.
    """
    samples = demo_tasks(split=split, num_samples=num_samples, seed=seed, tasks=tasks, word_len=word_len)
    rng = random.Random(f"tunekit-demo-pairs:{seed}:{split}")
    rejected = [_wrong_answer(sample, rng) for sample in samples]
    chosen = [_exchange(s["prompt"], s["answer"]) for s in samples]
    rejected = [_exchange(s["prompt"], answer) for s, answer in zip(samples, rejected)]
    return _Pairs(*(ChatDataset(conversations, tokenizer, train_on=train_on) for conversations in (chosen, rejected)))


def _wrong_answer(sample: dict[str, str], rng: random.Random) -> str:
    """Another task's answer on the sample's word, one that differs from the right one."""
    word = sample["prompt"].split(": ", 1)[1]
    wrong = sorted({TASKS[task](word) for task in TASKS} - {sample["answer"]})  # never empty: "repeat" is longer
    return rng.choice(wrong)


def demo_unpaired_dataset(
    tokenizer: ChatTokenizer,
    *,
    split: str = "train",
    num_samples: int = 20000,
    seed: int = 0,
    tasks: list[str] | None = None,
    word_len: tuple[int, int] = DEFAULT_WORD_LEN,
    desirable_share: float = 0.5,
) -> UnpairedDataset:
    """The demo tasks as answers judged one at a time, for KTO: each prompt once, with its right answer (desirable)
    for a ``desirable_share`` of them drawn from ``(split, seed)``, else with another task's answer on the same
    word (undesirable), so that no prompt has both: unpaired, as KTO's data are. Other arguments as
    :func:`demo_dataset`'s.
    """
    if not 0 <= desirable_share <= 1:
        raise UserError(f"desirable_share must be in [0, 1]; got {desirable_share!r}")
    samples = demo_tasks(split=split, num_samples=num_samples, seed=seed, tasks=tasks, word_len=word_len)
    rng = random.Random(f"tunekit-demo-unpaired:{seed}:{split}")
    desirable = [rng.random() < desirable_share for _ in samples]
    answers = [s["answer"] if good else _wrong_answer(s, rng) for s, good in zip(samples, desirable)]
    conversations = [_exchange(s["prompt"], answer) for s, answer in zip(samples, answers)]
    return UnpairedDataset(ChatDataset(conversations, tokenizer, train_on="last_turn"), desirable,
                           max_seq_len=tokenizer.max_seq_len, seed=seed)


def demo_prompt_dataset(
    tokenizer: ChatTokenizer,
    *,
    split: str = "train",
    num_samples: int = 1000,
    seed: int = 0,
    tasks: list[str] | None = None,
    word_len: tuple[int, int] = DEFAULT_WORD_LEN,
    system_prompt: str | None = None,
) -> PromptDataset:
    """The demo tasks as prompts for online RL (items as :func:`~toolkit.data.prompt_dataset`'s), each with its
    ``answer`` and ``task`` as fields, for an exact-match reward; ``where`` is ``demo <split> row <N>`` (1-based).
    Other arguments as :func:`demo_dataset`'s; ``system_prompt`` as :func:`~toolkit.data.prompt_dataset`'s.
    """
    fmt = PromptFormat(column="prompt", system_prompt=system_prompt)
    samples = demo_tasks(split=split, num_samples=num_samples, seed=seed, tasks=tasks, word_len=word_len)
    return PromptDataset([
        prompt_item(i, tokenizer, fmt.messages(sample), fmt.fields(sample), f"demo {split} row {i + 1}")
        for i, sample in enumerate(samples)
    ])


# The data sets above, which a config names as its `dataset` (any module path that ends in one of them).
_DEMO_DATASETS = ("demo_dataset", "demo_preference_dataset", "demo_unpaired_dataset", "demo_prompt_dataset")


def demo_data_warning(cfg: Any) -> str | None:
    """The line a run prints when it trains a real model on these synthetic tasks, or None.

    The shipped configs of real models start from the demo's data so that they run as they are; a user who forgets
    to point ``dataset`` at their own data would otherwise spend GPU hours teaching, say, Llama 3.1 8B to reverse
    four-letter words. A model read with the byte tokenizer, or built by a demo builder (``llama3_demo``,
    ``lora_llama3_demo``...), is the demo's own or a tiny one of its kind (a distillation student), trained from
    scratch or from the demo run: not warned about. A real model comes with its checkpoint's tokenizer.
    """
    # Each key read by name, and the ones every training recipe requires as attributes, as the recipes read them, so
    # that toolkit.config.recipe_keys (which reads this function too: recipe_setup hands it `cfg`) still finds them.
    model = str((cfg.model or {}).get("_component_", ""))
    tokenizer = str((cfg.tokenizer or {}).get("_component_", ""))
    if not model or "demo" in model.rsplit(".", 1)[-1] or tokenizer.endswith(".byte_tokenizer"):
        return None
    for key, node in (("dataset", cfg.dataset), ("validation_dataset", cfg.get("validation_dataset"))):
        component = str(node.get("_component_", "")) if hasattr(node, "get") else ""
        if component.startswith("toolkit.") and component.rsplit(".", 1)[-1] in _DEMO_DATASETS:
            # RL reads prompts with their answers; the others read conversations.
            prompts = component.endswith(".demo_prompt_dataset")
            builder, example = ("prompt_dataset", "prompts") if prompts else ("chat_dataset", "conversations")
            return (
                f"{key}: {component} is the demo's synthetic string tasks ('reverse: lamp' -> 'pmal'), not data to "
                f"fine-tune {model} on; point it at yours, e.g. {key}: {{_component_: toolkit.data.{builder}, "
                f"source: path/to/{example}.jsonl}}"
            )
    return None
