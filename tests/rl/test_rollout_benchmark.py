"""benchmarks/rl_rollout.py in its --smoke mode (a tiny Llama, one repeat): it runs, compares the same model in both
engines, and prints its table. No assertion on speed."""

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "rl_rollout.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("rl_rollout_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke_run_prints_both_engines_and_the_rl_step(bench, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["rl_rollout.py", "--smoke"])
    bench.main()
    out = capsys.readouterr().out
    # The two models are one: their logits agree to float rounding.
    diff = float(re.search(r"largest logit difference ([0-9.e+-]+)", out).group(1))
    assert diff < 1e-4
    assert "2 prompts x 2 samples = 4 rows" in out and "5 new tokens each" in out
    row = re.compile(r"^\| (ours|transformers) +\| +([0-9.]+) \| +([0-9.]+) \| +([0-9.]+)x \|$", re.MULTILINE)
    rows = {m.group(1): (float(m.group(2)), float(m.group(3)), float(m.group(4))) for m in row.finditer(out)}
    assert set(rows) == {"ours", "transformers"}
    for tokens_per_s, seconds, _ in rows.values():  # every row generated all 5 tokens (within the print's rounding)
        assert abs(tokens_per_s * seconds - 4 * 5) <= tokens_per_s * 0.0005 + 0.5 * seconds + 1e-9
    assert rows["transformers"][2] == 1.0
    assert rows["ours"][2] == pytest.approx(rows["ours"][0] / rows["transformers"][0], rel=0.01, abs=0.01)
    assert re.search(r"generation [0-9.]+ s \+ update [0-9.]+ s; generation \d+% of the step", out)


def test_two_different_models_are_refused(bench, tmp_path):
    args = bench.argparse.Namespace(**bench.SMOKE)
    bench.write_checkpoint(tmp_path, args)
    ours, theirs = bench.load_models(tmp_path, torch.device("cpu"), torch.float32)
    assert bench.check_same_model(ours, theirs, [1, 2, 3], torch.device("cpu")) < 1e-4
    with torch.no_grad():
        theirs.model.layers[0].mlp.up_proj.weight.add_(0.5)
    with pytest.raises(SystemExit, match="the two models disagree"):
        bench.check_same_model(ours, theirs, [1, 2, 3], torch.device("cpu"))
