import pytest

from toolkit.config import apply_overrides, load_config
from toolkit.data import (
    CROSS_ENTROPY_IGNORE_INDEX,
    ChatDataset,
    demo_data_warning,
    demo_dataset,
    demo_tasks,
    shifted_labels,
)
from toolkit.errors import UserError
from toolkit.paths import configs_dir
from toolkit.tokenizers import byte_tokenizer

ALL_TASKS = ["reverse", "upper", "sort", "repeat"]


def _expected_answer(task: str, word: str) -> str:
    # Written independently of the library's table.
    if task == "reverse":
        return "".join(word[i] for i in range(len(word) - 1, -1, -1))
    if task == "upper":
        return "".join(chr(ord(c) - 32) for c in word)
    if task == "sort":
        return "".join(c for c in "abcdefghijklmnopqrstuvwxyz" for _ in range(word.count(c)))
    if task == "repeat":
        return word + " " + word
    raise AssertionError(task)


def test_deterministic_and_prefix_stable() -> None:
    a = demo_tasks(num_samples=300, seed=3)
    assert a == demo_tasks(num_samples=300, seed=3)
    assert a[:100] == demo_tasks(num_samples=100, seed=3)
    assert a != demo_tasks(num_samples=300, seed=4)


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_answers_correct(split: str) -> None:
    samples = demo_tasks(split=split, num_samples=400)
    assert {s["task"] for s in samples} == set(ALL_TASKS)
    for s in samples:
        task, word = s["prompt"].split(": ")
        assert task == s["task"]
        assert 3 <= len(word) <= 6 and word.isascii() and word.isalpha() and word.islower()
        assert s["answer"] == _expected_answer(task, word)


def test_task_subset() -> None:
    samples = demo_tasks(num_samples=20, tasks=["upper"])
    assert {s["task"] for s in samples} == {"upper"}


def test_splits_disjoint_across_seeds() -> None:
    def words(samples: list[dict]) -> set[str]:
        return {s["prompt"].split(": ")[1] for s in samples}

    train = words(demo_tasks(split="train", num_samples=5000, seed=0)) | words(
        demo_tasks(split="train", num_samples=5000, seed=1)
    )
    heldout = words(demo_tasks(split="heldout", num_samples=1000, seed=0)) | words(
        demo_tasks(split="heldout", num_samples=1000, seed=7)
    )
    assert len(heldout) > 900
    assert not train & heldout


def test_bad_arguments() -> None:
    with pytest.raises(UserError, match="train, heldout"):
        demo_tasks(split="test")
    with pytest.raises(UserError, match="reverse, upper, sort, repeat"):
        demo_tasks(tasks=["reverse", "add"])
    with pytest.raises(UserError, match="non-empty"):
        demo_tasks(tasks=[])
    with pytest.raises(UserError, match="train_on"):
        demo_dataset(byte_tokenizer(), num_samples=4, train_on="nope")


@pytest.mark.parametrize("train_on", ["assistant", "all"])
def test_labels_are_shifted_mask(train_on: str) -> None:
    tok = byte_tokenizer()
    ds = demo_dataset(tok, split="heldout", num_samples=12, seed=5, train_on=train_on)
    samples = demo_tasks(split="heldout", num_samples=12, seed=5)
    assert len(ds) == 12
    for item, s in zip(ds, samples):
        tokens, mask = tok.tokenize_messages(
            [{"role": "user", "content": s["prompt"]}, {"role": "assistant", "content": s["answer"]}],
            train_on=train_on,
        )
        assert item["tokens"] == tokens
        labels = item["labels"]
        assert len(labels) == len(tokens) and labels[-1] == CROSS_ENTROPY_IGNORE_INDEX
        for i in range(len(tokens) - 1):
            assert labels[i] == (tokens[i + 1] if mask[i + 1] else -100)
        if train_on == "assistant":
            # The targets spell out the answer, its end of turn and eos.
            targets = [t for t in labels if t != -100]
            assert tok.decode(targets, skip_special_tokens=False) == s["answer"] + "<|eot|><|end_of_text|>"


def test_shifted_labels() -> None:
    assert shifted_labels([1, 2, 3, 4], [False, False, True, True]) == [-100, 3, 4, -100]
    assert shifted_labels([1, 2], [True, True], ignore_index=-1) == [2, -1]
    assert shifted_labels([], []) == []
    with pytest.raises(ValueError):
        shifted_labels([1, 2], [True])


def test_chat_dataset_names_bad_sample() -> None:
    ds = ChatDataset([[{"role": "user", "content": "x"}], [{"role": "robot", "content": "y"}]], byte_tokenizer())
    assert ds[0]["labels"] == [-100] * len(ds[0]["tokens"])
    with pytest.raises(UserError, match="sample 1: .*robot"):
        ds[1]


def test_demo_preference_pairs_prefer_the_right_answer_to_another_tasks():
    from toolkit.data import demo_preference_dataset, preference_collate
    from toolkit.data.demo import TASKS

    tok = byte_tokenizer()
    pairs = demo_preference_dataset(tok, split="heldout", num_samples=40, seed=2)
    again = demo_preference_dataset(tok, split="heldout", num_samples=40, seed=2)
    samples = demo_tasks(split="heldout", num_samples=40, seed=2)
    assert len(pairs) == 40 and [pairs[i] for i in range(40)] == [again[i] for i in range(40)]
    wrong_tasks = set()
    for i, sample in enumerate(samples):
        pair = pairs[i]
        answers = {name: tok.decode([t for t in pair[f"{name}_labels"] if t != CROSS_ENTROPY_IGNORE_INDEX])
                   for name in ("chosen", "rejected")}
        word, rejected = sample["prompt"].split(": ", 1)[1], answers["rejected"]
        assert answers["chosen"] == sample["answer"]  # (the byte tokenizer decodes its special tokens to nothing)
        assert rejected != sample["answer"] and rejected in {task(word) for task in TASKS.values()}
        wrong_tasks |= {name for name, task in TASKS.items() if task(word) == rejected}
        # The prompts are the same: the pair differs in the answer only.
        first = next(t for t, label in enumerate(pair["chosen_labels"]) if label != CROSS_ENTROPY_IGNORE_INDEX)
        assert pair["chosen_tokens"][: first + 1] == pair["rejected_tokens"][: first + 1]
    assert len(wrong_tasks) >= 3  # the rejected answers come from the other tasks, not one of them
    batch = preference_collate([pairs[0], pairs[1]], pad_id=0)
    assert batch["tokens"].shape[0] == 4


def test_label_noise_makes_a_share_of_answers_another_tasks_on_the_same_prompts() -> None:
    from toolkit.data.demo import TASKS

    clean = demo_tasks(num_samples=2000, seed=3)
    noisy = demo_tasks(num_samples=2000, seed=3, label_noise=0.3)
    assert [s["prompt"] for s in noisy] == [s["prompt"] for s in clean]  # the same prompts, only answers change
    wrong = [(c, n) for c, n in zip(clean, noisy) if c["answer"] != n["answer"]]
    assert 0.26 < len(wrong) / 2000 < 0.34  # binomial(2000, 0.3): 4 standard deviations either side
    for c, n in wrong:
        word = c["prompt"].split(": ", 1)[1]
        assert n["answer"] in {task(word) for name, task in TASKS.items() if name != c["task"]}
    assert demo_tasks(num_samples=50, seed=3, label_noise=0.3) == noisy[:50]  # deterministic, prefix-stable
    for bad in (1.0, -0.1):
        with pytest.raises(UserError, match="label_noise"):
            demo_tasks(num_samples=5, label_noise=bad)


_CHAT = "dataset={_component_: toolkit.data.chat_dataset, source: x.jsonl}"


@pytest.mark.parametrize(("config", "overrides", "warned"), [
    ("full_finetune/llama3_1_8b", [], "dataset"),
    ("preference_finetune/llama3_1_8b_dpo", [], "dataset"),
    ("distill/llama3_2_1b_from_llama3_1_8b", [], "dataset"),
    # Real data: no warning; real data but the demo's held-out set: that one named.
    ("full_finetune/llama3_1_8b", [_CHAT], None),
    ("full_finetune/llama3_1_8b", [_CHAT, "validation_dataset={_component_: toolkit.data.demo_dataset}"],
     "validation_dataset"),
    # The demo's own model, from scratch or trained by the full demo (LoRA on it): its data is the point.
    ("full_finetune/demo", [], None),
    ("lora_finetune/demo", ["checkpointer.checkpoint_dir=outputs/full_finetune_demo/final"], None),
    ("distill/demo", [], None),
])
def test_a_real_model_on_the_demo_data_is_warned_about_in_one_line(config, overrides, warned) -> None:
    cfg = load_config(configs_dir() / f"{config}.yaml")
    apply_overrides(cfg, overrides)
    warning = demo_data_warning(cfg)
    if warned is None:
        assert warning is None
        return
    assert warning is not None and "\n" not in warning
    assert warning.startswith(f"{warned}: toolkit.data.demo") and cfg.model._component_ in warning
    assert "toolkit.data.chat_dataset" in warning  # what to write instead

