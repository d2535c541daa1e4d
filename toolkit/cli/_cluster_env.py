"""The environment ``tune run`` sets up for its workers' NCCL and gloo, so that a cluster job needs no hand-written
exports: the network interface that reaches the other nodes, the InfiniBand devices, and a timed-out collective
that stops its process and leaves a trace in the run's folder. A variable the user set is never changed."""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from collections.abc import Mapping
from pathlib import Path

from toolkit.errors import UserError

# Where Linux lists the InfiniBand (and RoCE) devices; tests point it at a folder of their own.
INFINIBAND_SYSFS = Path("/sys/class/infiniband")
# Where Linux lists the IPv6 addresses of each interface (SIOCGIFADDR answers for IPv4 only).
IPV6_ADDRESSES = Path("/proc/net/if_inet6")
_SIOCGIFADDR = 0x8915
# The interface variables NCCL and gloo read; both are checked against this node's interfaces.
INTERFACE_VARIABLES = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
# Collectives each rank's flight recorder keeps (torch 2.13's default, written out so the line says what is kept).
_TRACE_ENTRIES = 2000


def interface_addresses() -> dict[str, set[str]]:
    """Each network interface of this machine with its addresses (empty where the system does not say)."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return {}
    addresses: dict[str, set[str]] = {name: set() for name in names}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            try:
                answer = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address
            addresses[name].add(socket.inet_ntoa(answer[20:24]))
    try:
        lines = IPV6_ADDRESSES.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:  # "<32 hex digits> <index> <prefix> <scope> <flags> <name>"
        fields = line.split()
        if len(fields) == 6 and fields[5] in addresses:
            addresses[fields[5]].add(str(ipaddress.IPv6Address(bytes.fromhex(fields[0]))))
    return addresses


def route_source(host: str, port: int) -> str | None:
    """The local address the kernel would send from to reach ``host`` (None where it cannot be resolved or routed).

    A UDP socket's connect only picks the route: no packet is sent.
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as s:
            s.connect(address)
            return str(s.getsockname()[0])
    except OSError:
        return None


def _routing_interface(host: str, port: int) -> tuple[str, str] | None:
    """The interface holding the address that reaches ``host``, with that address; None for a loopback address.

    A rendezvous host that is this machine, named by a name that resolves to 127.0.x.x, says nothing of the interface
    the other nodes reach it through: there torch's own choice (the hostname's address) is left.
    """
    source = route_source(host, port)
    if source is None or ipaddress.ip_address(source.split("%")[0]).is_loopback:
        return None
    for name, addresses in sorted(interface_addresses().items()):
        if source in addresses:
            return name, source
    return None


def _names_no_interface(value: str, names: list[str]) -> str | None:
    """The first entry of an interface list (NCCL's syntax: ``eth,ib`` prefixes, ``=eth0`` exact names, ``^lo``
    exclusions) that no interface of ``names`` matches; None when every entry matches one, or for an exclusion list.
    gloo takes exact names, which are also prefixes of themselves."""
    if value.startswith("^"):
        return None
    for entry in value.split(","):
        exact = entry.startswith("=")
        wanted = entry.removeprefix("=")
        if wanted and not any(name == wanted if exact else name.startswith(wanted) for name in names):
            return entry
    return None


def check_interface_names(*, uses_gpus: bool, environ: Mapping[str, str]) -> None:
    """Refuse an interface variable the user set (``NCCL_SOCKET_IFNAME`` where the recipe uses GPUs,
    ``GLOO_SOCKET_IFNAME`` always) that names no interface of this machine: the workers would stop in their first
    collective with a C++ error, or wait for a connection that never comes.

    Raises:
        UserError: naming the variable, its value, this node and its interfaces.
    """
    names = sorted(interface_addresses())
    if not names:
        return  # a system that does not list them: nothing to check against
    for variable in INTERFACE_VARIABLES:
        if variable not in environ or (variable == "NCCL_SOCKET_IFNAME" and not uses_gpus):
            continue
        entry = _names_no_interface(environ[variable], names)
        if entry is not None:
            raise UserError(
                f"{variable}={environ[variable]}: '{entry}' names no network interface of node "
                f"{socket.gethostname()} (it has {', '.join(names)}); name one of those, or unset it to let tune "
                "choose the one that reaches the rendezvous host"
            )


def _unset(environ: Mapping[str, str], *names: str) -> bool:
    """Whether none of ``names`` (a variable and the older names torch still reads for it) is set."""
    return not any(name in environ for name in names)


def worker_environment(
    *, rendezvous: tuple[str, int] | None, uses_gpus: bool, output_dir: str | None, environ: Mapping[str, str]
) -> list[tuple[dict[str, str], str]]:
    """What to add to the workers' environment, each group with the one line that says so.

    Args:
        rendezvous: the rendezvous host and port of a launch on several nodes; None on one node, where loopback
            serves and no interface is chosen.
        uses_gpus: whether the recipe will run on GPUs, where the NCCL variables apply.
        output_dir: the run's folder, where the flight recorder dumps on a timeout (None: torch's default, /tmp).
        environ: the environment the workers would inherit; nothing set there is changed.
    """
    groups: list[tuple[dict[str, str], str]] = []
    if rendezvous is not None:
        found = _routing_interface(*rendezvous)
        wanted = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME") if uses_gpus else ("GLOO_SOCKET_IFNAME",)
        unset = [name for name in wanted if name not in environ]
        if found is not None and unset:
            name, address = found
            groups.append(({variable: name for variable in unset},
                           f"network interface {name} ({address}, the route to the rendezvous host "
                           f"{rendezvous[0]}): {' and '.join(f'{v}={name}' for v in unset)}"))
    if not uses_gpus:
        return groups
    devices = sorted(p.name for p in INFINIBAND_SYSFS.iterdir()) if INFINIBAND_SYSFS.is_dir() else []
    if devices and "NCCL_IB_HCA" not in environ:
        hca = ",".join(devices)
        groups.append(({"NCCL_IB_HCA": hca}, f"InfiniBand devices for NCCL: NCCL_IB_HCA={hca}"))
    # 1 (TearDown): a collective that times out or fails stops its process, so the launcher sees the failure and
    # can restart the group; 3, torch's default outside torchrun, only aborts the communicator and leaves the rank
    # to wait on. torchrun sets 1 too; saying it here keeps the line and the behaviour in one place.
    if _unset(environ, "TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"):
        groups.append(({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"},
                       "a timed-out NCCL collective stops its process: TORCH_NCCL_ASYNC_ERROR_HANDLING=1"))
    recorder: dict[str, str] = {}
    # The TORCH_FR_ names are the ones torch 2.13's flight recorder reads first; the TORCH_NCCL_ ones are their older
    # aliases, which it still reads with a deprecation warning in every worker (so we do not set them), and a user's
    # value under either is kept. ProcessGroupNCCL's own check before a dump reads TORCH_NCCL_TRACE_BUFFER_SIZE,
    # whose default is 2000 too.
    if _unset(environ, "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        recorder["TORCH_FR_BUFFER_SIZE"] = str(_TRACE_ENTRIES)
    if _unset(environ, "TORCH_NCCL_DUMP_ON_TIMEOUT"):
        recorder["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
    if output_dir is not None and _unset(environ, "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        # Each rank appends its global rank to this prefix; the folder as the run reads it (~ expanded).
        folder = os.path.abspath(os.path.expanduser(output_dir))
        recorder["TORCH_FR_DUMP_TEMP_FILE"] = os.path.join(folder, "nccl_trace_rank_")
    if recorder:
        where = recorder.get("TORCH_FR_DUMP_TEMP_FILE")
        dump = f", dumped to {where}<RANK> on a timeout" if where else ""
        groups.append((recorder, f"NCCL flight recorder on{dump}: "
                                 f"{' '.join(f'{k}={v}' for k, v in recorder.items())}"))
    return groups
