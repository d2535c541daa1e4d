"""Several nodes through torchrun's c10d rendezvous, simulated by two launchers on localhost.

Each "node" is its own ``tune run --nnodes 2 ... --rdzv_backend c10d`` process, started concurrently, exactly as a
user would start one per machine (docs/multi_node.md). The job must train as one: with the same global batch the
losses equal those of a single process (promise 1; fp32, so within float rounding: 1e-5 relative, as in
test_parallel_parity.py), and only the node holding global rank 0 writes ``metrics.jsonl`` and the checkpoint.

c10d ignores ``--node_rank`` (torchrun warns so): the rendezvous numbers the nodes itself, in the order of their
(host, launcher pid). Each node therefore gets its own ``output_dir`` here, and the test finds which one was
node 0 by what it wrote, then checks that the other wrote nothing at all.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.launch import free_port, run_tune_here

REPO = Path(__file__).resolve().parents[2]
# Tiny and fast; words of 2 to 8 letters so that a wrong loss normalization across nodes would show.
COMMON = [
    "dataset.word_len=[2,8]", "max_steps=4", "dataset.num_samples=256", "progress_bar=false", "~eval_tasks",
    "batch_size=8", "micro_batch_size=2",
    # The "nodes" here have separate output folders, like nodes with local disks: step checkpoints need a shared
    # one (each rank writes its part), so they are off; the export falls back to rank zero writing alone.
    "save_every_n_steps=null",
]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
TIMEOUT_S = 150  # per launch; a healthy run takes ~20-30 s on a busy 2-core machine
# How often to retry a launch whose rendezvous port was taken by someone else between our probe and its use.
PORT_ATTEMPTS = 3


def read_losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def kill_group(proc: subprocess.Popen) -> None:
    """Stop a launcher and the workers it started (each launcher leads its own session)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def wait_all(
    procs: list[subprocess.Popen], logs: list[Path], *, timeout_s: float, stop_others: bool = True
) -> list[subprocess.CompletedProcess]:
    """Wait for every launcher; with ``stop_others``, as soon as one fails, stop the others (they would wait for it
    in the rendezvous or at a collective until a timeout). Return what each printed, and in each result's
    ``ended`` when (``time.monotonic()``, to 0.2 s) its launcher exited by itself (None if it was stopped)."""
    deadline = time.monotonic() + timeout_s
    ended: dict[int, float] = {}
    while any(p.poll() is None for p in procs):
        ended.update({i: time.monotonic() for i, p in enumerate(procs) if p.poll() is not None and i not in ended})
        if stop_others and any(p.poll() not in (None, 0) for p in procs):
            break
        if time.monotonic() > deadline:
            for p in procs:
                kill_group(p)
            raise AssertionError(f"the nodes did not finish within {timeout_s} s")
        time.sleep(0.2)
    ended.update({i: time.monotonic() for i, p in enumerate(procs) if p.poll() is not None and i not in ended})
    for p in procs:
        kill_group(p)
    results = []
    for i, (p, log) in enumerate(zip(procs, logs)):
        result = subprocess.CompletedProcess(
            p.args, p.returncode, log.with_suffix(".out").read_text(), log.with_suffix(".err").read_text()
        )
        result.ended = ended.get(i)
        results.append(result)
    return results


def launch_nodes(
    outs: list[Path], logs: Path, nproc_per_node: int, *args: str, env: dict[str, str] | None = None,
    check: bool = True, stop_others: bool = True, node_env: list[dict[str, str]] | None = None,
) -> list[subprocess.CompletedProcess]:
    """Start one ``tune run`` per node, concurrently, and wait for all of them (bounded); with ``check``, every
    node must succeed; ``stop_others``: see :func:`wait_all`; ``node_env``: more environment for each node.

    Output goes to files under ``logs`` rather than pipes: a failing job's tracebacks could fill a pipe that
    nobody reads while we poll, and block the launcher.

    Node 0 is told to host the rendezvous store (``is_host``): if its port was taken meanwhile, it fails at
    once and we retry on a new port and a new rendezvous id, instead of both nodes joining a stranger's store.
    """
    for attempt in range(PORT_ATTEMPTS):
        port, run_id = free_port(), uuid.uuid4().hex[:12]
        procs: list[subprocess.Popen] = []
        node_logs: list[Path] = []
        try:
            for node, out in enumerate(outs):
                cmd = [
                    sys.executable, "-m", "toolkit.cli.main", "run",
                    "--nnodes", str(len(outs)), "--node_rank", str(node), "--nproc_per_node", str(nproc_per_node),
                    "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", run_id,
                    "--rdzv_conf", f"is_host={int(node == 0)}",
                    "full_finetune_distributed", "--config", "demo", f"output_dir={out}", *COMMON, *args,
                ]
                logs.mkdir(parents=True, exist_ok=True)
                node_logs.append(logs / f"node{node}-try{attempt}")
                with node_logs[-1].with_suffix(".out").open("w") as stdout, \
                        node_logs[-1].with_suffix(".err").open("w") as stderr:
                    # The child keeps its own copies of the descriptors; ours can close at once.
                    procs.append(subprocess.Popen(
                        cmd, stdout=stdout, stderr=stderr, start_new_session=True,
                        env={**ENV, **(env or {}), **(node_env[node] if node_env else {})},
                    ))
            results = wait_all(procs, node_logs, timeout_s=TIMEOUT_S, stop_others=stop_others)
        finally:
            # On a timeout or an error, leave no launcher or worker behind; a no-op for those that finished.
            for proc in procs:
                kill_group(proc)
        port_taken = any("address already in use" in r.stderr.lower() for r in results)
        if port_taken and attempt + 1 < PORT_ATTEMPTS:
            continue
        for node, r in enumerate(results):
            assert r.returncode == 0 or not check, f"node {node} failed:\n{r.stderr[-3000:]}"
        return results
    raise AssertionError("unreachable")


def run_single_process(out: Path) -> list[float]:
    # `tune run` on one device runs the recipe in its own process: here, this one.
    result = run_tune_here("run", "full_finetune_single_device", "--config", "demo", f"output_dir={out}", *COMMON)
    assert result.returncode == 0, result.stderr[-3000:]
    return read_losses(out)


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory) -> Path:
    """One process, 4 micro-steps of 2 per optimizer step: the same global batch of 8."""
    out = tmp_path_factory.mktemp("reference")
    run_single_process(out)
    return out


@pytest.fixture(scope="module")
def reference(reference_dir) -> list[float]:
    return read_losses(reference_dir)


def assert_one_writer(outs: list[Path], reference: list[float]) -> None:
    """Exactly one node (global rank 0's) wrote metrics and the checkpoint; its losses match the reference."""
    writers = [out for out in outs if (out / "metrics.jsonl").exists()]
    assert len(writers) == 1, f"expected one node to write metrics, got {writers}"
    (writer,) = writers
    for out in outs:
        if out != writer:
            # prepare_output_dir, metrics and saves all run on rank 0 only: the other node's folder never appears.
            assert not out.exists(), f"a node other than node 0 wrote {sorted(out.rglob('*'))}"
    assert (writer / "final" / "model.safetensors").is_file()
    losses = read_losses(writer)
    assert len(losses) == len(reference)
    torch.testing.assert_close(losses, reference, rtol=1e-5, atol=0)


def test_two_nodes_one_process_each_train_like_one_process(reference, tmp_path):
    outs = [tmp_path / "node0", tmp_path / "node1"]
    results = launch_nodes(outs, tmp_path / "logs", 1, "data_parallel=ddp")
    assert_one_writer(outs, reference)
    # The job really spanned both launchers: a world of 2, one process per node.
    assert any("2 processes on cpu" in r.stdout for r in results)


@pytest.mark.slow  # two launchers, four workers
def test_hsdp_two_nodes_two_processes_each(reference, tmp_path):
    """HSDP on a (replicate=2 nodes, shard=2 processes) mesh: shard within a node, replicate across nodes."""
    outs = [tmp_path / "node0", tmp_path / "node1"]
    results = launch_nodes(outs, tmp_path / "logs", 2, "data_parallel=hsdp")
    assert_one_writer(outs, reference)
    assert any("4 processes on cpu" in r.stdout and "hsdp" in r.stdout for r in results)



def test_step_checkpoints_on_unshared_folders_stop_before_an_old_run_is_cleared(tmp_path):
    # Each "node" has its own output folder (local disks): step checkpoints cannot be written there, which must stop
    # the run in one line before overwrite=true clears the old run in node 0's folder, and create nothing in it.
    outs = [tmp_path / "node0", tmp_path / "node1"]
    (outs[0] / "final").mkdir(parents=True)
    (outs[0] / "metrics.jsonl").write_text("{}\n")
    before = sorted(p.relative_to(outs[0]) for p in outs[0].rglob("*"))
    results = launch_nodes(outs, tmp_path / "logs", 1, "data_parallel=ddp", "save_every_n_steps=2", "overwrite=true",
                           check=False)
    assert all(r.returncode != 0 for r in results)
    assert any("not on a filesystem all nodes share" in r.stderr for r in results)
    assert sorted(p.relative_to(outs[0]) for p in outs[0].rglob("*")) == before

class DemoWithAStall(torch.utils.data.Dataset):
    """The demo dataset, calling ``stall()`` before its read of the first sample of step 3 (batch 8: 8 / world size
    samples a step on each rank), outside any collective."""

    def __init__(self, dataset, stall):
        self.dataset, self.stall, self.reads = dataset, stall, 0
        self.stall_at = 2 * (8 // int(os.environ["WORLD_SIZE"])) + 1

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        self.reads += 1
        if self.reads == self.stall_at:
            self.stall()
        return self.dataset[index]


def dataset_stalling_rank_zero(tokenizer, **kwargs):
    """Rank 0 of a job's first attempt stalls for 60 s (the launcher stops the process during the sleep); a
    component for the test below, imported by the recipe through PYTHONPATH."""
    from toolkit.data import demo_dataset

    def stall():
        if os.environ.get("RANK") == "0" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
            time.sleep(60)

    return DemoWithAStall(demo_dataset(tokenizer, **kwargs), stall)


@pytest.mark.slow  # two launchers, each restarting its worker
def test_a_rank_lost_on_one_node_is_recovered_on_both(reference, tmp_path):
    """--max_restarts across nodes (promise 3): rank 1 dies after step 2 while rank 0, on the other node, is busy
    outside a collective. Rank 1's launcher restarts its worker as attempt 1; rank 0's launcher restarts its own for
    the new rendezvous round but, torchrun counting restarts per node, still as attempt 0. Both must meet again (they
    hung, each looking for the other under its own attempt's keys, or read the dead round's addresses) and agree
    that this is a restart: rank 0 resumes from step_2 (it took itself for a fresh start, and overwrite=true cleared
    the checkpoints and trained from step 0)."""
    out = tmp_path / "shared"  # one folder for both nodes: a shared filesystem, as step checkpoints need
    results = launch_nodes(
        [out, out], tmp_path / "logs", 1, "--max_restarts", "1", "save_every_n_steps=1", "overwrite=true",
        "dist_timeout_s=60", "dataset._component_=tests.training.test_multinode.dataset_stalling_rank_zero",
        env={"TUNE_INJECT_FAULT": "after_step:2:1"},
    )
    stdout = "".join(r.stdout for r in results)
    assert stdout.count(f"resumed at step 2 from {out / 'checkpoints' / 'step_2'}") == 1, stdout
    # One worker failed (the killed one, silently): no other worker failed on the way to the recovery.
    assert not any("Traceback" in r.stderr for r in results), [r.stderr[-3000:] for r in results]
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    torch.testing.assert_close(read_losses(out), reference, rtol=1e-5, atol=0)


def dataset_hanging_rank_one(tokenizer, **kwargs):
    """Rank 1 (or, where ``$TUNE_TEST_HANG_HERE`` is set, the ranks that see it set to 1) hangs for good, once per
    test and rank: the file ``$TUNE_TEST_HANG_MARKER_rank_<rank>`` records that it did (torchrun's restart counts
    are per node, so they cannot tell a restarted job apart)."""
    from toolkit.data import demo_dataset

    def hang():
        chosen = os.environ.get("TUNE_TEST_HANG_HERE", "1" if os.environ.get("RANK") == "1" else "0") == "1"
        marker = Path(f"{os.environ['TUNE_TEST_HANG_MARKER']}_rank_{os.environ['RANK']}")
        if chosen and not marker.exists():
            marker.touch()
            while True:
                time.sleep(1)

    return DemoWithAStall(demo_dataset(tokenizer, **kwargs), hang)


HANG = ["dist_timeout_s=20", "dataset._component_=tests.training.test_multinode.dataset_hanging_rank_one"]


@pytest.mark.slow  # two launchers; the job waits out dist_timeout_s
def test_ranks_stuck_on_one_node_end_the_job_on_both_with_their_stacks(tmp_path):
    """Two nodes of two processes: both ranks of node 0 hang outside any collective. Node 1's ranks wait for them in
    a collective and fail after dist_timeout_s (20 s), and so does node 1's launcher; node 0's launcher, which hosts
    the rendezvous store, knows nothing of that and would keep the job up forever: the stuck ranks' watchdogs must
    end it within dist_timeout_s + their grace (10 s) of their last progress, and leave their stacks (the first to
    exit, or both: its launcher then stops the other). Stuck on node 1 instead, the job ends anyway: node 1's
    launcher loses the store when node 0's exits."""
    out = tmp_path / "shared"
    from toolkit.training.watchdog import GRACE_S

    results = launch_nodes([out, out], tmp_path / "logs", 2, *HANG, check=False, stop_others=False,
                           env={"TUNE_TEST_HANG_MARKER": str(tmp_path / "hung")},
                           node_env=[{"TUNE_TEST_HANG_HERE": "1"}, {"TUNE_TEST_HANG_HERE": "0"}])
    assert list(tmp_path.glob("hung_rank_*"))
    assert all(r.returncode != 0 and r.ended is not None for r in results), [r.stderr[-2000:] for r in results]
    # The waiting rank's node ends first (the collective's timeout); the stuck rank's within the grace and a few
    # seconds for its launcher to notice and tear down.
    assert results[1].ended < results[0].ended < results[1].ended + GRACE_S + 25
    dumps = sorted((out / "watchdog").iterdir())
    assert 1 <= len(dumps) <= 2
    for dump in dumps:
        rank = dump.name.split("_")[1]  # rank_<rank>_<host>.txt: c10d numbers the nodes itself
        assert dump.name == f"rank_{rank}_{socket.gethostname()}.txt"
        stacks = dump.read_text()
        assert stacks.startswith(f"rank {rank} on {socket.gethostname()} made no progress for ")
        assert "in __getitem__" in stacks  # the stuck thread's frame, in faulthandler's words
    assert (f"exited with code 1: RankStuck: rank {rank} on {socket.gethostname()} made no progress"
            in results[0].stderr)
    assert any(str(dump) in results[0].stderr for dump in dumps)


@pytest.mark.slow  # two launchers, each restarting its worker after the timeout
def test_a_rank_stuck_on_one_node_is_restarted_and_the_run_finishes_as_if_uninterrupted(reference_dir, tmp_path):
    # Two nodes of two processes; rank 1 hangs in the first attempt. Whichever way the job ends (the others' timeout,
    # its watchdog), both launchers start it again and it resumes from its last step checkpoint.
    out = tmp_path / "shared"  # one folder for both nodes: a shared filesystem, as step checkpoints need
    results = launch_nodes(
        [out, out], tmp_path / "logs", 2, "--max_restarts", "1", "save_every_n_steps=1", "overwrite=true", *HANG,
        env={"TUNE_TEST_HANG_MARKER": str(tmp_path / "hung")},
    )
    assert list(tmp_path.glob("hung_rank_*"))
    stdout = "".join(r.stdout for r in results)
    assert stdout.count(f"resumed at step 2 from {out / 'checkpoints' / 'step_2'}") == 1, stdout
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    torch.testing.assert_close(read_losses(out), read_losses(reference_dir), rtol=1e-5, atol=0)
    resumed, uninterrupted = (load_file(d / "final" / "model.safetensors") for d in (out, reference_dir))
    assert resumed.keys() == uninterrupted.keys()
    for key in resumed:
        torch.testing.assert_close(resumed[key], uninterrupted[key], rtol=1e-5, atol=1e-6)


def test_nodes_with_different_torch_versions_are_refused_in_one_line(tmp_path):
    # A node set up apart from the others (the test hook fakes its torch version): every rank stops at start-up,
    # before training, with one line naming each version and its host, and exit code 2 on both nodes.
    host = socket.gethostname()
    outs = [tmp_path / "node0", tmp_path / "node1"]
    results = launch_nodes(outs, tmp_path / "logs", 1, "data_parallel=ddp", check=False, stop_others=False,
                           node_env=[{}, {"TUNE_TEST_FAKE_TORCH_VERSION": "2.0.0"}])
    assert [r.returncode for r in results] == [2, 2], [r.stderr[-2000:] for r in results]
    expected = (f"tune: error: the nodes run different torch versions (torch {torch.__version__} on {host}; "
                f"torch 2.0.0 on {host}): install the same on every node")
    for r in results:
        errors = [line for line in r.stderr.splitlines() if line.startswith("tune: error:")]
        assert errors in ([expected], [expected.replace(f"torch {torch.__version__} on {host}; torch 2.0.0 on {host}",
                                                        f"torch 2.0.0 on {host}; torch {torch.__version__} on {host}")])
        assert "Traceback" not in r.stderr
    assert not any((out / "metrics.jsonl").exists() for out in outs)
