"""Process groups and devices: the one place that reads torchrun's environment."""

import os
import socket
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from toolkit.errors import UserError
from toolkit.versions import torch_version


@dataclass(frozen=True)
class DistributedEnv:
    """Where this process sits in the job.

    Attributes:
        rank: global rank (0 when not distributed).
        local_rank: rank on this node; picks the GPU.
        world_size: number of processes in the job.
        local_world_size: processes on this node.
        device: this process's device (``cuda:<local_rank>`` or ``cpu``).
        backend: the backend of this device's collectives, ``nccl`` or ``gloo`` (on GPUs, CPU tensors go through a
            gloo backend of the same group), or ``None`` for a single process without a process group.
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str | None

    @property
    def is_rank_zero(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.backend is not None


def init_distributed(*, device: str = "auto", timeout_s: float = 600.0) -> DistributedEnv:
    """Read rank and world size from torchrun's environment, pick the device, and join the process group.

    Args:
        device: ``auto`` (CUDA if available, else CPU), ``cuda`` or ``cpu``.
        timeout_s: how long a collective may wait before the job fails instead of hanging. Lower it to see a
            stuck rank sooner; raise it for very slow checkpoint writes.

    Raises:
        UserError: ``device: cuda`` on a machine without a GPU, or an unknown device.
    """
    if device not in ("auto", "cuda", "cpu"):
        raise UserError(f"device: unknown value {device!r}; use 'auto', 'cuda' or 'cpu'")
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("device: 'cuda' was asked for but no GPU is visible (check CUDA_VISIBLE_DEVICES/drivers)")
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    if use_cuda:
        torch_device = torch.device("cuda", local_rank)
        torch.cuda.set_device(torch_device)
    else:
        torch_device = torch.device("cpu")
    backend = None
    if world_size > 1 or "TORCHELASTIC_RUN_ID" in os.environ:
        backend = "nccl" if use_cuda else "gloo"
        if not dist.is_initialized():
            dist.init_process_group(
                # On GPUs, NCCL for CUDA tensors and gloo for the small CPU ones (token counts, flags, objects):
                # NCCL alone refuses a CPU tensor ("No backend type associated with device type cpu").
                backend="cpu:gloo,cuda:nccl" if use_cuda else "gloo",
                timeout=timedelta(seconds=timeout_s),
                device_id=torch_device if use_cuda else None,
                **_restart_store(rank=rank, world_size=world_size, timeout_s=timeout_s),
            )
            _agree_on_restart_count()
            _check_same_torch()
    return DistributedEnv(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        device=torch_device,
        backend=backend,
    )


def _restart_store(*, rank: int, world_size: int, timeout_s: float) -> dict:
    """After torchrun restarted the workers (``--max_restarts``), a store whose keys are this attempt's alone.

    With the launcher's store shared across attempts (``TORCHELASTIC_USE_AGENT_STORE``: the static rendezvous, or
    plain torchrun with c10d), the process group's bootstrap keys (each rank's address) carry no attempt number: a
    restarted rank would read the address of the dead one and fail to connect. Returns ``init_process_group``'s
    store arguments; none without a restart, and none when every attempt gets a fresh store of its own (`tune run`
    asks torchrun for one under c10d): there the nodes may disagree on the attempt number (see
    :func:`_agree_on_restart_count`), so a prefix made of it would keep them apart.
    """
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
    )
    return {"store": dist.PrefixStore(f"tunekit/attempt_{attempt}", store), "rank": rank, "world_size": world_size}


def _agree_on_restart_count() -> None:
    """Make ``TORCHELASTIC_RESTART_COUNT`` the job's, the same on every rank: the largest of the nodes' counts.

    torchrun counts restarts per node: when a worker fails on one node, that node's launcher restarts its workers
    with the count raised, while the other nodes' launchers restart theirs for the new rendezvous round with the
    count unchanged (a membership change is not a retry). Rank zero could then see 0 and take a recovery for a
    fresh start (refuse the folder, or clear it with ``overwrite``), and a fault injected for the first attempt
    would fire again. Every reader (resume, fault injection) goes through the environment, so it is set there.
    """
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return
    count = torch.tensor(int(os.environ["TORCHELASTIC_RESTART_COUNT"]))
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(int(count.item()))


def _check_same_torch() -> None:
    """Refuse, on every rank at once, a job whose processes run different torch versions (a node set up apart from
    the others): their collectives and checkpoints may disagree in ways no error names. ``tune doctor`` reports the
    same across nodes before a job.

    Raises:
        UserError: the versions differ; the line names each version and the hosts that run it.
    """
    mine = (socket.gethostname(), torch_version())
    everyone: list[tuple[str, str]] = [mine] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    hosts_by_version: dict[str, list[str]] = {}
    for host, version in everyone:
        if host not in hosts_by_version.setdefault(version, []):
            hosts_by_version[version].append(host)
    if len(hosts_by_version) > 1:
        found = "; ".join(f"torch {version} on {', '.join(hosts)}" for version, hosts in hosts_by_version.items())
        raise UserError(f"the nodes run different torch versions ({found}): install the same on every node")


def destroy_distributed() -> None:
    """Leave the process group (a no-op without one)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(value: torch.Tensor, *, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum ``value`` over the ranks of ``group`` (default: all) in place and return it (identity without a process
    group)."""
    if dist.is_initialized():
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
    return value


def barrier() -> None:
    """Wait for every rank (a no-op without a process group)."""
    if dist.is_initialized():
        dist.barrier()


def on_rank_zero(fn, *args, **kwargs):
    """Run ``fn`` on rank zero only and return its result on every rank; if it raises a UserError, raise the same
    error on every rank.

    For work that touches shared files (checking or clearing the output folder, finding the checkpoint to resume
    from): without this, rank zero would fail alone while the others wait at the next collective until the
    timeout, or the ranks could see the folder at different moments and decide differently.
    """
    error = None
    result = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            result = fn(*args, **kwargs)
        except UserError as e:
            error = str(e)
    if dist.is_initialized():
        box = [error, result]
        dist.broadcast_object_list(box, src=0)
        error, result = box
    if error is not None:
        raise UserError(error)
    return result


def shared_filesystem(folder: str | Path) -> bool:
    """Whether every rank sees the same ``folder`` (its nodes share the filesystem); True without a group.

    A collective. Rank zero writes a token file into ``folder``, which every rank then looks for.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return True
    folder = Path(folder)
    token = [f".shared-{uuid.uuid4().hex}" if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0)
    path = folder / token[0]
    if dist.get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
        path.touch()
    dist.barrier()
    seen = torch.tensor(int(path.exists()))
    dist.all_reduce(seen, op=dist.ReduceOp.MIN)
    if dist.get_rank() == 0:
        path.unlink()
    return bool(seen.item())
