"""``tune doctor``: check that a machine (and, with several processes, a group of them) is ready to fine-tune.

Each check is a small function of what it looks at (versions, an environment, a size), so a test can hand it any
value; :func:`local_checks` feeds them this machine's facts. With ``--nproc_per_node`` (and the torchrun flags for
several nodes) every process runs the checks under torch's elastic launcher, as ``tune run`` launches recipes, and
then measures its collectives (``_doctor_worker.py``); the table then also says where the processes disagree.

Exit codes: 0 when no check fails (warnings do not fail), 1 when one fails, 2 for bad input.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from toolkit.cli._cluster_env import (
    INFINIBAND_SYSFS,
    INTERFACE_VARIABLES,
    _names_no_interface,
    interface_addresses,
)
from toolkit.errors import UserError, print_error
from toolkit.versions import torch_version

OK, WARN, FAIL = "ok", "warn", "fail"
_SEVERITY = {OK: 0, WARN: 1, FAIL: 2}
GIB = 1024**3
# Below this /dev/shm, NCCL's shared-memory transport and DataLoader workers run out of room (docker's default is 64M).
SHM_MIN_BYTES = 1 * GIB
# Below this much free disk under the output folder, a run's checkpoints of a 7-8B model no longer fit.
DISK_MIN_BYTES = 20 * GIB
# Written by the workers of each node, read by that node's `tune doctor`: its exit code (see _doctor_worker.py).
VERDICT_FILE_ENV = "TUNE_DOCTOR_VERDICT_FILE"


@dataclass(frozen=True)
class Row:
    """One line of the table. ``same_everywhere``: every process of a group must find the same (a version)."""

    check: str
    verdict: str
    found: str
    fix: str = ""
    same_everywhere: bool = False


@dataclass(frozen=True)
class _Variable:
    """An environment variable known to break or slow NCCL or torch, when set to one of ``values`` (any value
    where None)."""

    name: str
    values: tuple[str, ...] | None
    reason: str
    fix: str
    only_with_infiniband: bool = False


# The variables flagged by `tune doctor`, each with why and what to do. All warn: each has a rare legitimate use.
RISKY_VARIABLES = (
    _Variable("NCCL_P2P_DISABLE", ("1",), "GPUs exchange data through host memory, not NVLink/PCIe peer to peer",
              "unset NCCL_P2P_DISABLE (keep it only to work around broken peer-to-peer)"),
    _Variable("NCCL_IB_DISABLE", ("1",), "NCCL uses TCP sockets instead of this node's InfiniBand/RoCE devices",
              "unset NCCL_IB_DISABLE", only_with_infiniband=True),
    _Variable("NCCL_SHM_DISABLE", ("1",), "processes of one node talk through sockets instead of shared memory",
              "unset NCCL_SHM_DISABLE (a small /dev/shm is better fixed with --shm-size)"),
    _Variable("NCCL_DEBUG", ("TRACE",), "NCCL logs every call: slow", "NCCL_DEBUG=INFO or WARN, or unset it"),
    _Variable("CUDA_LAUNCH_BLOCKING", ("1",), "every CUDA kernel launch waits for the GPU: slow",
              "unset CUDA_LAUNCH_BLOCKING (it is for debugging)"),
    _Variable("TORCH_NCCL_BLOCKING_WAIT", ("1",), "each collective blocks the CPU until it ends: slower",
              "unset TORCH_NCCL_BLOCKING_WAIT"),
    _Variable("NCCL_ALGO", None, "forces NCCL's algorithm instead of its choice per message size",
              "unset NCCL_ALGO unless a benchmark on this cluster chose it"),
    _Variable("NCCL_PROTO", None, "forces NCCL's protocol instead of its choice per message size",
              "unset NCCL_PROTO unless a benchmark on this cluster chose it"),
    _Variable("CUDA_VISIBLE_DEVICES", ("",), "set but empty: torch sees no GPU",
              "unset CUDA_VISIBLE_DEVICES or list the GPUs to use"),
)


def _gib(size: int) -> str:
    return f"{size / GIB:.1f} GiB"


# --- the checks: each a function of what it looks at ---------------------------------------------------------------


def check_python(version: Sequence[int]) -> Row:
    found = ".".join(str(part) for part in version[:3])
    if tuple(version[:2]) < (3, 10):
        return Row("python", FAIL, found, "use Python 3.10 or newer", same_everywhere=True)
    return Row("python", OK, found, same_everywhere=True)


def check_torch(version: str) -> Row:
    return Row("torch", OK, version, same_everywhere=True)


def check_cuda(cuda_version: str | None, gpu_count: int) -> Row:
    """The CUDA torch was built for; a CUDA build that sees no GPU warns (driver, container, CUDA_VISIBLE_DEVICES)."""
    if cuda_version is None:
        return Row("cuda", OK, "none (torch built for CPU)", same_everywhere=True)
    if gpu_count == 0:
        return Row("cuda", WARN, f"{cuda_version}, but no GPU visible",
                   "check the driver (nvidia-smi), the container's --gpus, CUDA_VISIBLE_DEVICES", same_everywhere=True)
    return Row("cuda", OK, cuda_version, same_everywhere=True)


def check_nccl(version: tuple[int, ...] | None) -> Row:
    if version is None:
        return Row("nccl", OK, "no GPU", same_everywhere=True)
    return Row("nccl", OK, ".".join(str(part) for part in version), same_everywhere=True)


def check_driver(driver: str | None, gpu_count: int) -> Row:
    """``driver``: nvidia-smi's driver version, None where nvidia-smi is absent or fails."""
    if driver is not None:
        return Row("driver", OK, driver, same_everywhere=True)
    if gpu_count == 0:
        return Row("driver", OK, "no GPU (nvidia-smi not found or failed)")
    return Row("driver", WARN, "nvidia-smi not found or failed", "install the NVIDIA utilities to see the driver")


def check_gpus(names: Sequence[str]) -> Row:
    if not names:
        return Row("gpus", OK, "no GPU")
    counts: dict[str, int] = {}
    for name in names:
        counts[name] = counts.get(name, 0) + 1
    return Row("gpus", OK, f"{len(names)}: " + ", ".join(f"{n} x {name}" for name, n in counts.items()))


def check_gpu_links(topology: str | None, gpu_count: int) -> Row:
    """The links between GPUs from ``nvidia-smi topo -m``: NVLink (``NV<n>``) is ok, anything else (PCIe through a
    switch, a host bridge, or across CPU sockets) warns, naming the pairs."""
    if gpu_count < 2:
        return Row("gpu links", OK, "fewer than 2 GPUs")
    if topology is None:
        return Row("gpu links", WARN, "nvidia-smi topo -m not available", "install the NVIDIA utilities")
    slow: list[str] = []
    for line in topology.splitlines():
        fields = line.split()
        # A GPU's row starts with its name (the header, which lists the same names, starts with blanks) and has X
        # where it meets its own column.
        if line[:1].isspace() or not fields or not re.fullmatch(r"GPU\d+", fields[0]):
            continue
        row = int(fields[0][3:])
        if len(fields) <= row + 1 or fields[row + 1] != "X":
            continue
        for column, link in enumerate(fields[1:1 + gpu_count]):
            if column > row and not link.startswith("NV"):
                slow.append(f"GPU{row}-GPU{column} {link}")
    if not slow:
        return Row("gpu links", OK, "NVLink between every pair")
    return Row("gpu links", WARN, "not NVLink: " + ", ".join(slow),
               "expect lower bandwidth between these GPUs; see `nvidia-smi topo -m`")


def check_network(addresses: Mapping[str, set[str]]) -> Row:
    """The interfaces with their IPv4 addresses; only loopback means no other node can reach this one."""
    ipv4 = {name: sorted(a for a in found if ":" not in a) for name, found in sorted(addresses.items())}
    shown = ", ".join(f"{name} {' '.join(found) or '(no IPv4)'}" for name, found in ipv4.items()) or "none listed"
    outside = [name for name, found in ipv4.items() if found and not all(a.startswith("127.") for a in found)]
    if addresses and not outside:
        return Row("network", WARN, shown, "only loopback has an address: other nodes cannot reach this one")
    return Row("network", OK, shown)


def check_infiniband(devices: Sequence[str]) -> Row:
    return Row("infiniband", OK, ", ".join(devices) if devices else "none found")


def check_shm(total_bytes: int | None) -> Row:
    if total_bytes is None:
        return Row("/dev/shm", WARN, "not mounted", "mount a tmpfs on /dev/shm (docker: --shm-size=16g)")
    if total_bytes < SHM_MIN_BYTES:
        return Row("/dev/shm", WARN, f"{_gib(total_bytes)} (NCCL and DataLoader workers need more)",
                   "docker run --shm-size=16g, or mount -o remount,size=16G /dev/shm")
    return Row("/dev/shm", OK, _gib(total_bytes))


def check_memlock(limit: int, infiniband: Sequence[str]) -> Row:
    """The locked-memory limit: InfiniBand registers (locks) NCCL's buffers, so a limit there warns."""
    found = "unlimited" if limit == resource.RLIM_INFINITY else f"{limit // 1024} KiB"
    if limit == resource.RLIM_INFINITY or not infiniband:
        return Row("locked memory", OK, found)
    return Row("locked memory", WARN, f"{found} with InfiniBand devices",
               "ulimit -l unlimited (docker: --ulimit memlock=-1)")


def check_environment(environ: Mapping[str, str], interfaces: Sequence[str], infiniband: Sequence[str]) -> list[Row]:
    """A row per variable of :data:`RISKY_VARIABLES` set to a harmful value, and a failing row per interface
    variable naming no interface of this machine; one ok row when there is none."""
    rows: list[Row] = []
    for variable in RISKY_VARIABLES:
        value = environ.get(variable.name)
        if value is None or (variable.values is not None and value.upper() not in variable.values):
            continue
        if variable.only_with_infiniband and not infiniband:
            continue
        rows.append(Row(f"env {variable.name}", WARN, f"{variable.name}={value}: {variable.reason}", variable.fix))
    for name in INTERFACE_VARIABLES:
        value = environ.get(name)
        entry = None if value is None or not interfaces else _names_no_interface(value, list(interfaces))
        if entry is not None:
            rows.append(Row(f"env {name}", FAIL, f"{name}={value}: '{entry}' is no interface of this machine "
                            f"(it has {', '.join(interfaces)})", f"name one of those, or unset {name}"))
    return rows or [Row("environment", OK, "no NCCL/CUDA variable known to break or slow training")]


def check_disk(free_bytes: int, path: str) -> Row:
    if free_bytes < DISK_MIN_BYTES:
        return Row("disk", WARN, f"{_gib(free_bytes)} free under {path}",
                   f"free space or choose another --output_dir (checkpoints need {_gib(DISK_MIN_BYTES)} or more)")
    return Row("disk", OK, f"{_gib(free_bytes)} free under {path}")


# --- this machine's facts --------------------------------------------------------------------------------------------


def _command_output(*command: str) -> str | None:
    """What ``command`` prints, or None where it is absent, fails or takes more than 10 s."""
    if shutil.which(command[0]) is None:
        return None
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout if result.returncode == 0 else None


def _shm_bytes(path: str = "/dev/shm") -> int | None:
    try:
        stats = os.statvfs(path)
    except OSError:
        return None
    return stats.f_blocks * stats.f_frsize


def local_checks(output_dir: str, environ: Mapping[str, str] | None = None) -> list[Row]:
    """Every check on this machine, in the table's order."""
    import torch

    environ = os.environ if environ is None else environ
    gpu_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    names = [torch.cuda.get_device_name(i) for i in range(gpu_count)]
    nccl = tuple(torch.cuda.nccl.version()) if gpu_count else None  # type: ignore[attr-defined]
    driver = _command_output("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader") if gpu_count else None
    topology = _command_output("nvidia-smi", "topo", "-m") if gpu_count > 1 else None
    addresses = interface_addresses()
    infiniband = sorted(p.name for p in INFINIBAND_SYSFS.iterdir()) if INFINIBAND_SYSFS.is_dir() else []
    try:
        free = shutil.disk_usage(output_dir).free
    except OSError as e:
        raise UserError(f"--output_dir {output_dir}: {e.strerror or e}") from None
    return [
        check_python(sys.version_info),
        check_torch(torch_version(environ)),  # (a test hook can fake it: toolkit.versions)
        check_cuda(torch.version.cuda, gpu_count),
        check_nccl(nccl),
        check_driver(driver.splitlines()[0].strip() if driver else None, gpu_count),
        check_gpus(names),
        check_gpu_links(topology, gpu_count),
        check_network(addresses),
        check_infiniband(infiniband),
        check_shm(_shm_bytes()),
        check_memlock(resource.getrlimit(resource.RLIMIT_MEMLOCK)[0], infiniband),
        *check_environment(environ, sorted(addresses), infiniband),
        check_disk(free, output_dir),
    ]


# --- several processes: one row per check ----------------------------------------------------------------------------


def combine(per_rank: Sequence[tuple[str, Sequence[Row]]]) -> list[Row]:
    """One row per check from every process's rows (``per_rank[r]``: rank r's host and rows).

    A check every process must agree on (``same_everywhere``) that differs fails, naming who found what. Otherwise
    the worst verdict is kept, with the ranks where it was found when not all found the same.
    """
    order: list[str] = []
    found: dict[str, list[tuple[int, str, Row]]] = {}
    for rank, (host, rows) in enumerate(per_rank):
        for row in rows:
            if row.check not in found:
                order.append(row.check)
                found[row.check] = []
            found[row.check].append((rank, host, row))
    combined: list[Row] = []
    for check in order:
        entries = found[check]
        values = {row.found for _, _, row in entries}
        first = entries[0][2]
        if len(values) == 1 and len(entries) == len(per_rank):
            combined.append(first)
            continue
        groups: dict[str, list[str]] = {}
        for rank, host, row in entries:
            groups.setdefault(row.found, []).append(f"{host} rank {rank}")
        where = "; ".join(f"{value} on {', '.join(ranks)}" for value, ranks in groups.items())
        if first.same_everywhere:
            combined.append(Row(check, FAIL, f"differs: {where}", f"install the same {check} on every node"))
            continue
        worst = max((row for _, _, row in entries), key=lambda row: _SEVERITY[row.verdict])
        ranks = [f"{host} rank {rank}" for rank, host, row in entries if row.found == worst.found]
        if len(ranks) < len(per_rank):
            combined.append(Row(check, worst.verdict, f"{worst.found} (on {', '.join(ranks)})", worst.fix))
        else:
            combined.append(worst)
    return combined


# --- output ----------------------------------------------------------------------------------------------------------


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Rows as left-aligned columns, the last column unpadded."""
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header) - 1)]
    lines = []
    for row in [header, *rows]:
        cells = [f"{cell!s:<{width}}" for cell, width in zip(row, widths)]
        lines.append("  ".join([*cells, str(row[-1])]).rstrip())
    return "\n".join(lines)


def checks_table(rows: Sequence[Row]) -> str:
    return format_table(("CHECK", "VERDICT", "FOUND", "FIX"), [(r.check, r.verdict, r.found, r.fix) for r in rows])


def exit_code(rows: Sequence[Row]) -> int:
    """0 when no check failed, else 1."""
    return 1 if any(row.verdict == FAIL for row in rows) else 0


def row_to_dict(row: Row) -> dict[str, object]:
    """A row as plain data, for ``all_gather_object``."""
    return asdict(row)


# --- the command -----------------------------------------------------------------------------------------------------


def _check_numbers(args: argparse.Namespace) -> None:
    for flag, value, least in (("--nproc_per_node", args.nproc_per_node, 1), ("--nnodes", args.nnodes, 1),
                               ("--node_rank", args.node_rank, 0)):
        if value is not None and value < least:
            raise UserError(f"{flag} must be at least {least}, got {value}")
    if args.node_rank >= args.nnodes:
        raise UserError(f"--node_rank {args.node_rank} must be below --nnodes {args.nnodes}")
    if args.nnodes > 1 and not args.rdzv_endpoint:
        raise UserError("--nnodes above 1 needs --rdzv_endpoint HOST:PORT, the same on every node")
    if args.timeout_s < 1:
        raise UserError(f"--timeout_s must be at least 1, got {args.timeout_s}")


def doctor(args: argparse.Namespace) -> int:
    """Run ``tune doctor``: the local checks in this process, or the workers under the elastic launcher."""
    _check_numbers(args)
    if not os.path.isdir(args.output_dir):
        raise UserError(f"--output_dir {args.output_dir}: no such folder")
    if args.nproc_per_node is None and args.nnodes == 1 and not args.rdzv_endpoint:
        rows = local_checks(args.output_dir)
        print(checks_table(rows))
        return exit_code(rows)
    return _launch(args)


def _check_resolves(endpoint: str) -> None:
    """Refuse a rendezvous host that does not resolve: the store would retry it for minutes."""
    import socket

    host = endpoint.rsplit(":", 1)[0].strip("[]") if ":" in endpoint else endpoint
    try:
        socket.getaddrinfo(host, None)
    except OSError as e:
        raise UserError(f"--rdzv_endpoint {endpoint}: cannot resolve {host} ({e.strerror or e})") from None


def _launch(args: argparse.Namespace) -> int:
    """Start the workers as ``tune run`` starts a recipe's (its launcher, rendezvous checks and failure report),
    and exit with the verdict the workers of this node leave in a file."""
    import tempfile

    from toolkit.cli._cluster_env import check_interface_names
    from toolkit.cli._run import (
        _check_gpus_per_node,
        _check_launch_flags,
        _import_torch_quietly,
        _run_distributed,
        _torchrun_parser,
        _uses_gpus,
    )

    _import_torch_quietly(["--nproc_per_node"])  # a launch: the store's C++ retry logs stay off, as for tune run
    import torch

    if args.rdzv_endpoint:
        _check_resolves(args.rdzv_endpoint)
    uses_gpus = _uses_gpus("auto")
    # A wrong interface would make the collectives wait for a connection that never comes: fail now, with tune run's
    # own check, on both variables whatever the device (the machine is checked for any job).
    check_interface_names(uses_gpus=True, environ=os.environ)
    flags = ["--nproc_per_node", str(args.nproc_per_node or (torch.cuda.device_count() if uses_gpus else 1)),
             "--nnodes", str(args.nnodes), "--node_rank", str(args.node_rank)]
    if args.rdzv_endpoint:
        flags += ["--rdzv_backend", "c10d", "--rdzv_endpoint", args.rdzv_endpoint,
                  "--rdzv_conf", f"join_timeout={args.timeout_s},read_timeout={args.timeout_s}"]
    worker = Path(__file__).with_name("_doctor_worker.py")
    launch = _torchrun_parser().parse_args([*flags, str(worker)])
    _check_launch_flags(launch)
    _check_gpus_per_node(launch, device="auto")  # each process takes the GPU of its local rank
    with tempfile.TemporaryDirectory(prefix="tune-doctor-") as folder:
        verdict = Path(folder) / "verdict"
        os.environ[VERDICT_FILE_ENV] = str(verdict)
        try:
            code = _run_distributed(
                launch, worker, ["--output_dir", args.output_dir, "--timeout_s", str(args.timeout_s)],
                uses_gpus=uses_gpus, output_dir=None,
            )
        except UserError as e:  # tune run's words, with this command's flag for the time the nodes wait
            raise UserError(str(e).replace("--rdzv_conf join_timeout=SECONDS", "--timeout_s SECONDS")) from None
        finally:
            del os.environ[VERDICT_FILE_ENV]
        if code != 0:
            return code
        if not verdict.is_file():
            print_error("the workers ended without a verdict; see their output above")
            return 1
        return int(verdict.read_text().strip() or 1)


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register ``tune doctor`` on the ``tune`` subcommand parsers."""
    parser = commands.add_parser(
        "doctor",
        help="check this machine (and a group of them) for training: versions, GPUs, network, NCCL settings",
        description=(
            "Check this machine: torch, CUDA, NCCL, driver and Python versions, the GPUs and their links, network\n"
            "and InfiniBand devices, /dev/shm, the locked-memory limit, environment variables known to break or\n"
            "slow NCCL, and free disk under --output_dir. With --nproc_per_node (and --nnodes, --node_rank,\n"
            "--rdzv_endpoint for several nodes) every process runs the checks, then measures all-reduce and\n"
            "all-gather bus bandwidth (gloo on CPU, NCCL on GPU) and names a rank much slower than the others.\n"
            "Exit code: 0 when no check fails (warnings do not), 1 when one fails, 2 for bad input."
        ),
        epilog=(
            "examples:\n"
            "  tune doctor\n"
            "  tune doctor --nproc_per_node 2\n"
            "  tune doctor --nnodes 2 --node_rank 0 --rdzv_endpoint host:29400 --nproc_per_node 8  # on each node"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--output_dir", default=".", metavar="DIR", help="folder whose free disk is checked")
    parser.add_argument("--nproc_per_node", "--nproc-per-node", type=int, metavar="N",
                        help="processes on this node: run the checks in each and measure collectives")
    parser.add_argument("--nnodes", type=int, default=1, metavar="N", help="nodes taking part (default 1)")
    parser.add_argument("--node_rank", "--node-rank", type=int, default=0, metavar="K", help="this node's rank")
    parser.add_argument("--rdzv_endpoint", "--rdzv-endpoint", metavar="HOST:PORT",
                        help="where the nodes meet (c10d rendezvous), the same on every node")
    parser.add_argument("--timeout_s", type=int, default=120, metavar="S",
                        help="longest wait for the nodes to meet and for each collective (default 120)")
    parser.set_defaults(handler=doctor)
