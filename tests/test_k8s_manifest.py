"""scripts/k8s/pytorchjob.yaml, the Kubernetes template beside the Slurm one: it parses, its pods are what the docs
say (a c10d rendezvous at the master pod, restarts, a shared volume for output_dir, /dev/shm in memory, GPUs), and
the `tune run` in it names a recipe, config and overrides that exist, checked as the docs' skipped commands are."""

from __future__ import annotations

from pathlib import Path

import yaml

import toolkit.cli._run as run_module
from tests.test_docs import REPO, check_without_running

MANIFEST = REPO / "scripts" / "k8s" / "pytorchjob.yaml"


def _flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def _manifest() -> dict[str, dict]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(MANIFEST.read_text())}


def test_the_pytorchjob_runs_tune_on_every_node_with_a_shared_volume_and_restarts() -> None:
    manifest = _manifest()
    claim, job = manifest["PersistentVolumeClaim"], manifest["PyTorchJob"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert job["apiVersion"] == "kubeflow.org/v1"
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert set(replicas) == {"Master", "Worker"} and replicas["Master"]["replicas"] == 1
    assert all(spec["restartPolicy"] == "OnFailure" for spec in replicas.values())
    assert replicas["Master"]["template"] == replicas["Worker"]["template"]  # every node runs the same command
    pod = replicas["Master"]["template"]["spec"]
    (container,) = pod["containers"]
    command = container["command"]
    assert command[:2] == ["tune", "run"]
    assert int(_flag(command, "--nnodes")) == sum(spec["replicas"] for spec in replicas.values())
    assert int(_flag(command, "--nproc_per_node")) == container["resources"]["limits"]["nvidia.com/gpu"]
    assert _flag(command, "--rdzv_backend") == "c10d"
    name = job["metadata"]["name"]
    # The operator's service for the master pod, on the port the container declares.
    assert _flag(command, "--rdzv_endpoint") == f"{name}-master-0:{container['ports'][0]['containerPort']}"
    assert _flag(command, "--rdzv_id") == name
    assert _flag(command, "--max_restarts") == "3"

    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    mounts = {mount["mountPath"]: volumes[mount["name"]] for mount in container["volumeMounts"]}
    assert mounts["/dev/shm"]["emptyDir"]["medium"] == "Memory"
    shared = next(path for path, volume in mounts.items() if "persistentVolumeClaim" in volume)
    assert mounts[shared]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    overrides = dict(word.split("=", 1) for word in command if "=" in word)
    assert Path(overrides["output_dir"]).is_relative_to(shared)
    assert Path(overrides["checkpointer.checkpoint_dir"]).is_relative_to(shared)


def test_the_tune_run_command_in_it_names_what_exists(monkeypatch, tmp_path, capsys) -> None:
    (container,) = _manifest()["PyTorchJob"]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
    checked = []
    # The shared volume is not mounted here: what rank 0 would check of output_dir is only recorded.
    monkeypatch.setattr(run_module, "_check_output_dir", lambda cfg, schema: checked.append(cfg.output_dir))
    monkeypatch.chdir(tmp_path)
    check_without_running(container["command"][1:], monkeypatch=monkeypatch, capsys=capsys)
    assert checked == ["/shared/outputs/llama3_1_8b_lora"]


def test_the_docs_show_it_beside_slurm() -> None:
    docs = (REPO / "docs" / "multi_node.md").read_text()
    assert docs.index("## Slurm") < docs.index("## Kubernetes") < docs.index("## Choosing a strategy")
    assert "scripts/k8s/pytorchjob.yaml" in docs
