"""lm-evaluation-harness tasks through the eval recipe: a multiple-choice, a generation and a perplexity task on the
demo model report what our own computation gives, the same on 2 processes as on 1, chat templates render every
prompt in the tokenizer's chat format, and a missing lm-eval, a misspelled task or chat settings that cannot work
stop with one line."""

import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch

from tests.launch import RecipeRun, run_recipe_here, run_recipes
from toolkit.errors import UserError
from toolkit.generation import generate
from toolkit.paths import install_command
from toolkit.tokenizers import byte_tokenizer
from toolkit.training import HFCheckpointer

TOKENIZER = byte_tokenizer()
# Only the harness runs (the demo's perplexity and exact-match sets are off), on our task files alone.
HARNESS_ONLY = ["dataset=null", "eval_tasks=null", "lm_eval.include_defaults=false", "lm_eval.batch_size=4"]
TASKS = "lm_eval.tasks=[demo_choice,demo_answer,demo_text]"
CHOICES = ["red", "green", "blue"]
PROMPTS = ["Say cat:", "Say dog:", "Q: 2+2=", "The sky is"]
STOP = "."
TEXTS = ["A short text.", "A text longer than the model's 64 positions, " * 3]


def run_eval(out: Path, *overrides: str) -> dict:
    """The eval recipe's ``main`` on the demo config, in this process; returns ``eval.json``."""
    run_recipe_here("eval", "demo", f"output_dir={out}", *HARNESS_ONLY, *overrides)
    return json.loads((out / "eval.json").read_text())


def own_answer(model: torch.nn.Module, prompt: str) -> str:
    """What the demo_answer task's settings ask for, computed without the harness: 8 greedy tokens at most, cut
    before the first stop string."""
    tokens = generate(model, TOKENIZER.encode(prompt, add_eos=False), max_new_tokens=8, stop_tokens=TOKENIZER.stop_tokens)
    return TOKENIZER.decode(tokens).split(STOP)[0]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, random_demo_model, write_lm_eval_task) -> dict:
    """The random demo model as a Hugging Face checkpoint, three tasks over it, and the 1-process report."""
    pytest.importorskip("lm_eval")
    from toolkit.evaluation.lm_eval_model import ToolkitLM

    root = tmp_path_factory.mktemp("lm_eval")
    model = random_demo_model()
    checkpoint = HFCheckpointer(None, model_family="llama3").save(model, root / "checkpoint")
    questions = [f"Which colour is number {i}?" for i in range(6)]
    write_lm_eval_task(
        root / "tasks", "demo_choice", [{"question": q, "gold": i % 3} for i, q in enumerate(questions)],
        output_type="multiple_choice", doc_to_text="{{question}}", doc_to_choice=CHOICES, doc_to_target="{{gold}}",
        metric_list=[{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
    )
    # Half the answers are the model's own greedy ones: exact match 0.5.
    answers = [own_answer(model, p) if i % 2 == 0 else "not this" for i, p in enumerate(PROMPTS)]
    write_lm_eval_task(
        root / "tasks", "demo_answer", [{"prompt": p, "answer": a} for p, a in zip(PROMPTS, answers)],
        output_type="generate_until", doc_to_text="{{prompt}}", doc_to_target="{{answer}}",
        generation_kwargs={"until": [STOP], "max_gen_toks": 8, "do_sample": False},
        metric_list=[{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
    )
    tasks = write_lm_eval_task(
        root / "tasks", "demo_text", [{"text": t} for t in TEXTS],
        output_type="loglikelihood_rolling", doc_to_text="", doc_to_target="{{text}}",
        metric_list=[{"metric": "byte_perplexity"}],
    )

    # What the harness should make of our adapter's answers: lm-eval scores " " + choice after the question.
    lm = ToolkitLM(model, TOKENIZER)
    correct = 0
    for i, question in enumerate(questions):
        scores = [s for s, _ in lm.loglikelihood([_request("loglikelihood", question, f" {c}") for c in CHOICES])]
        ranked = sorted(scores)
        assert ranked[-1] - ranked[-2] > 1e-3, "no near-tie that float rounding could flip"
        correct += scores.index(max(scores)) == i % 3
    text_logprob = sum(lm.loglikelihood_rolling([_request("loglikelihood_rolling", t) for t in TEXTS]))
    expected = {
        "demo_choice": {"acc": correct / len(questions)},
        "demo_answer": {"exact_match": 0.5},
        "demo_text": {"byte_perplexity": math.exp(-text_logprob / sum(len(t.encode()) for t in TEXTS))},
    }
    overrides = [f"checkpointer.checkpoint_dir={checkpoint}", TASKS, f"lm_eval.include_path={tasks}"]
    return {"overrides": overrides, "expected": expected, "report": run_eval(root / "one", *overrides)}


def _request(kind: str, *args):
    from lm_eval.api.instance import Instance

    return Instance(request_type=kind, doc={}, arguments=args, idx=0, metadata=("demo", 0, 1))


def test_tasks_report_what_our_own_computation_gives(setup):
    report = setup["report"]["lm_eval"]
    for task, expected in setup["expected"].items():
        for name, value in expected.items():
            assert report[task]["metrics"][name] == pytest.approx(value, rel=1e-6), (task, name)
    assert {task: (r["samples"], r["num_fewshot"]) for task, r in report.items()} == {
        "demo_choice": (6, 0), "demo_answer": (4, 0), "demo_text": (2, 0),
    }
    assert report["demo_choice"]["metrics"]["acc_stderr"] > 0  # lm-eval's standard error, kept next to the metric


def test_the_table_shows_the_metrics(setup, tmp_path, capsys):
    report = run_eval(tmp_path, *setup["overrides"], "lm_eval.limit=2")
    table = capsys.readouterr().out
    acc = report["lm_eval"]["demo_choice"]["metrics"]
    assert re.search(rf"^demo_choice acc +{acc['acc']:.4f} ± {acc['acc_stderr']:.4f}$", table, flags=re.M)
    assert re.search(r"^demo_choice samples +2 \(0-shot\)$", table, flags=re.M)



def test_a_group_reports_the_samples_of_its_tasks(tmp_path, capsys, write_lm_eval_task):
    pytest.importorskip("lm_eval")
    import yaml

    for name, count in [("part_a", 3), ("part_b", 2)]:
        write_lm_eval_task(
            tmp_path / "tasks", name, [{"question": f"Which colour is {i}?", "gold": i % 3} for i in range(count)],
            output_type="multiple_choice", doc_to_text="{{question}}", doc_to_choice=CHOICES, doc_to_target="{{gold}}",
            metric_list=[{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
        )
    (tmp_path / "tasks" / "parts.yaml").write_text(yaml.safe_dump({
        "group": "parts", "task": ["part_a", "part_b"],
        "aggregate_metric_list": [{"metric": "acc", "aggregation": "mean", "weight_by_size": True}],
    }))
    report = run_eval(tmp_path / "out", "checkpointer.checkpoint_dir=null", "lm_eval.tasks=[parts]",
                      f"lm_eval.include_path={tmp_path / 'tasks'}")["lm_eval"]
    # lm-eval counts the documents of tasks only; a group's are those of its tasks (was null, "None" in the table).
    assert {task: r["samples"] for task, r in report.items()} == {"parts": 5, "part_a": 3, "part_b": 2}
    assert re.search(r"^parts samples +5 \(0-shot\)$", capsys.readouterr().out, flags=re.M)

@pytest.fixture(scope="module")
def two_process_reports(setup, tmp_path_factory) -> dict[str, dict]:
    """The eval recipe on 2 processes under ddp, under zero3 and with the model split over both (tensor_parallel=2),
    one after the other in one launch: by layout, the ``lm_eval`` part of each run's eval.json."""
    root = tmp_path_factory.mktemp("two_processes")
    runs = {
        layout: RecipeRun("eval", root / layout, *overrides, *HARNESS_ONLY, *setup["overrides"])
        for layout, overrides in LAYOUTS.items()
    }
    result = run_recipes(list(runs.values()), nproc=2, env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    return {name: json.loads((r.output_dir / "eval.json").read_text())["lm_eval"] for name, r in runs.items()}


# ddp: whole copies, each process scores and generates for its share of the requests. zero3: FSDP2, every forward a
# collective: shares of the scoring padded to the same number of batches, every answer generated on both processes.
# tp2: one model over both processes, which score and generate every request together (gathered logits).
LAYOUTS = {"ddp": ["data_parallel=ddp"], "zero3": ["data_parallel=zero3"], "tp2": ["tensor_parallel=2"]}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_processes_report_what_one_does(setup, two_process_reports, layout):
    two = two_process_reports[layout]
    one = setup["report"]["lm_eval"]
    assert two.keys() == one.keys()
    for task in one:
        # The same requests in other batches (other padded lengths) round differently in float32.
        assert two[task]["metrics"] == pytest.approx(one[task]["metrics"], rel=1e-6), task
        assert two[task]["samples"] == one[task]["samples"]


def test_without_lm_eval_the_error_says_what_to_install(tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "lm_eval" or m.startswith("lm_eval.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` now fails as if it were not installed
    with pytest.raises(UserError) as error:
        run_eval(tmp_path, "checkpointer.checkpoint_dir=null", "lm_eval.tasks=[arc_easy]")
    assert str(error.value) == (
        f"lm_eval.tasks needs lm-evaluation-harness (no module named 'lm_eval'): {install_command('eval')}"
    )
    assert not (tmp_path / "eval.json").exists()


def test_a_misspelled_task_is_named_before_the_model_loads(setup, tmp_path):
    pytest.importorskip("lm_eval")
    tasks = setup["overrides"][-1].split("=", 1)[1]
    with pytest.raises(UserError, match=rf"lm_eval.tasks: no task 'demo_choise' among the task files under {tasks}; "
                                        r"did you mean 'demo_choice'\?"):
        run_eval(tmp_path, "checkpointer.checkpoint_dir=/nonexistent", "lm_eval.tasks=[demo_choise]", f"lm_eval.include_path={tasks}")


def test_with_chat_templates_every_prompt_is_a_rendered_chat(tmp_path, write_lm_eval_task, monkeypatch):
    pytest.importorskip("lm_eval")
    from toolkit.evaluation import ChatTemplate
    from toolkit.evaluation.lm_eval_model import ToolkitLM

    # Two documents a task, one example each: a document's few-shot example is the other one.
    questions, gold = ["Which colour is the sky?", "Which colour is grass?"], [2, 1]
    write_lm_eval_task(
        tmp_path / "tasks", "chat_choice", [{"question": q, "gold": g} for q, g in zip(questions, gold)],
        output_type="multiple_choice", doc_to_text="{{question}}", doc_to_choice=CHOICES, doc_to_target="{{gold}}",
        fewshot_split="test", metric_list=[{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
    )
    # gen_prefix: lm-eval prefills the answer and asks for the final message left open.
    tasks = write_lm_eval_task(
        tmp_path / "tasks", "chat_answer", [{"prompt": p, "answer": "yes"} for p in PROMPTS[:2]],
        output_type="generate_until", doc_to_text="{{prompt}}", doc_to_target="{{answer}}", gen_prefix="Answer:",
        fewshot_split="test", generation_kwargs={"until": [STOP], "max_gen_toks": 4, "do_sample": False},
        metric_list=[{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
    )
    received = []  # the (context, continuation or generation settings) of every request the adapter gets

    def spy(method: str):
        answer = getattr(ToolkitLM, method)
        return lambda self, requests: received.extend(r.args for r in requests) or answer(self, requests)

    for method in ("loglikelihood", "generate_until"):
        monkeypatch.setattr(ToolkitLM, method, spy(method))
    run_eval(
        tmp_path / "out", "checkpointer.checkpoint_dir=null", "lm_eval.tasks=[chat_choice,chat_answer]",
        f"lm_eval.include_path={tasks}", "lm_eval.num_fewshot=1", "lm_eval.apply_chat_template=true",
        "lm_eval.fewshot_as_multiturn=true", "lm_eval.system_instruction=Be brief.",
    )

    render = ChatTemplate(TOKENIZER).render
    system = {"role": "system", "content": "Be brief."}

    def example(question: str, answer: str) -> list[dict]:
        return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]

    # With a chat template lm-eval scores each choice right after the generation prompt (no " " before it).
    expected = [
        (render([system, *example(questions[1 - i], CHOICES[gold[1 - i]]), {"role": "user", "content": q}]), choice)
        for i, q in enumerate(questions) for choice in CHOICES
    ]
    expected += [
        (render([system, *example(PROMPTS[1 - i], "Answer: yes"), *example(p, "Answer:")], add_generation_prompt=False),)
        for i, p in enumerate(PROMPTS[:2])
    ]
    # A generation request's settings are left out: (context,).
    assert sorted(args if isinstance(args[1], str) else args[:1] for args in received) == sorted(expected)


def test_fewshot_as_multiturn_without_chat_templates_stops_before_the_model_loads(tmp_path):
    with pytest.raises(UserError, match=r"^lm_eval.fewshot_as_multiturn: true needs lm_eval.apply_chat_template: true"):
        run_eval(
            tmp_path, "checkpointer.checkpoint_dir=/nonexistent", "lm_eval.tasks=[arc_easy]",
            "lm_eval.fewshot_as_multiturn=true",
        )
