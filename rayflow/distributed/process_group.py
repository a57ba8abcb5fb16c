"""Process groups between Ray actors.

- The backend follows the device, decided in one place: nccl for CUDA tensors, gloo otherwise.
- Rendezvous is a TCP store on a free port of the rank-0 actor's node (rank 0 picks the port and
  hosts the store; the caller hands (address, port) to the others).
- A process may belong to several named groups at once (a replica's CFG group and the weight-sync
  group, say): each CollectiveGroup is a standalone ProcessGroup on its own store prefix, not
  carved out of a global default group, so groups of different membership coexist.
- Every collective has a timeout; a timed-out or broken collective raises CollectiveError naming
  the group, this rank and the node, instead of hanging, whether it fails while it runs or as it is enqueued (NCCL
  refuses a collective on an aborted communicator there). Forming a group waits at least
  FORM_TIMEOUT_FLOOR_S: a short collective timeout (noticing a stalled peer fast) must not fail a join
  that a loaded node merely starts late.
- Collective traffic and the rank-0 store bind to the network interface that holds the node's Ray
  address (loopback on a laptop run), never to every interface or to whatever the hostname resolves
  to: torch's TCPStore listens on all interfaces unless handed a socket bound by us.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist

FORM_TIMEOUT_FLOOR_S = 30.0
"""The least time forming a group (store connect, gloo's pairwise connect) waits for its members."""

ANSWER_GRACE_S = 10.0
"""The most one side of a failed or timed-out collective gives the others, past the collective timeout, to answer."""


def answer_grace_s(collective_timeout_s: float) -> float:
    """How long past `collective_timeout_s` the other members of a collective get to answer (fail their own side,
    report) before they are taken for stalled: ANSWER_GRACE_S, or the timeout when shorter. A run that sets a short
    collective timeout asks for quick verdicts, and answering takes a round trip, not a timeout's worth."""
    return min(ANSWER_GRACE_S, collective_timeout_s)


def device_backend(device: torch.device | str) -> str:
    """nccl when the device is CUDA, gloo otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def node_ip() -> str:
    """This node's address as Ray knows it (127.0.0.1 for a loopback-only local Ray)."""
    import ray

    return ray.util.get_node_ip_address()


def listening_socket(address: str, port: int = 0) -> socket.socket:
    """A TCP socket bound to `address` (only) and `port` (0: a free one), listening."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((address, port))
        listener.listen()
    except OSError:
        listener.close()  # a port taken: its descriptor is not left to the garbage collector
        raise
    return listener


_HELD: dict[tuple[str, int], socket.socket] = {}
"""Sockets a rendezvous bound (Rendezvous.on_this_node) until this process, the group's rank 0, opens its store on
them: a port picked free and let go until then could be bound by another group's rank 0 on the node (EADDRINUSE;
a port came back within 8 picks 13 times in 20,000)."""


def interface_of(address: str) -> str | None:
    """The network interface holding `address`, e.g. "lo" for 127.0.0.1."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addrs):
            return name
    return None


def bind_collectives_to(address: str) -> None:
    """Make gloo and nccl use the interface of `address` (set before the first group is created)."""
    interface = interface_of(address)
    if interface is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = interface
        os.environ["NCCL_SOCKET_IFNAME"] = interface


@dataclass(frozen=True)
class Rendezvous:
    """Where a group's members meet: rank 0's TCP store."""

    address: str
    port: int

    @staticmethod
    def on_this_node() -> "Rendezvous":
        """A rendezvous at a port of this node that it holds, listening, for this process's rank 0 (open_store)."""
        address = node_ip()
        listener = listening_socket(address)
        rendezvous = Rendezvous(address, listener.getsockname()[1])
        _HELD[(address, rendezvous.port)] = listener
        return rendezvous


class GroupHost:
    """An actor that may be rank 0 of a process group: the driver asks it for the rendezvous (a free port of its
    node, where the group's TCP store will listen) and hands that to every member. Rollout ranks, learner ranks and
    the weight-sync actor are each one."""

    def rendezvous(self) -> Rendezvous:
        return Rendezvous.on_this_node()


def open_store(rendezvous: Rendezvous, rank: int, size: int, timeout: datetime.timedelta) -> tuple[dist.TCPStore, socket.socket | None]:
    """The group's TCP store: rank 0 hosts it on a socket bound to the rendezvous address only (keep the
    returned socket alive as long as the store); the other ranks connect to it."""
    listener = None
    if rank == 0:
        key = (rendezvous.address, rendezvous.port)
        listener = _HELD.pop(key, None) or listening_socket(*key)
    store = dist.TCPStore(
        rendezvous.address, rendezvous.port, size, is_master=(rank == 0), timeout=timeout, wait_for_workers=False,
        **({"master_listen_fd": listener.fileno()} if listener is not None else {}),
    )
    return store, listener


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names the group, rank and node."""


class LeftGroup(CollectiveError):
    """A rank refuses its group's collectives: it failed between two of them, so its next ones would pair with its
    peers' of another call (the message names the rank and that failure)."""


class CollectiveGroup:
    """One named group of `size` ranks. Methods take and return tensors on this rank's device."""

    def __init__(self, name: str, rendezvous: Rendezvous, rank: int, size: int, device: torch.device | str,
                 timeout_s: float = 300.0, spin_s: float = 0.0):
        """`spin_s`: on gloo (CPU), poll each collective for up to that long, yielding the core, before blocking in its
        wait. For collectives that wait a few milliseconds between compute, as CFG-parallel ranks do each step: on a
        2-core VM a thread that blocked there computed slower after it woke, and polling made a W = 2 replica 1.68-1.72x
        as fast as W = 1 against 1.47-1.53x (README, Rollout — CFG parallelism). NCCL's wait does not block the CPU: it
        never spins."""
        self.name, self.rank, self.size = name, rank, size
        self.device = torch.device(device)
        self.backend = device_backend(self.device)
        self.timeout_s = timeout_s
        self.spin_s = spin_s if self.backend == "gloo" else 0.0
        self.address = node_ip()
        bind_collectives_to(self.address)
        timeout = datetime.timedelta(seconds=timeout_s)
        # Forming the group may take longer than a collective may: a member on a loaded node starts its join late.
        forming = datetime.timedelta(seconds=max(timeout_s, FORM_TIMEOUT_FLOOR_S))
        self._pg = None
        self._store, self._listener = open_store(rendezvous, rank, size, forming)
        store = dist.PrefixStore(f"rayflow/{name}", self._store)
        try:
            if self.backend == "gloo":
                options = dist.ProcessGroupGloo._Options()
                options._timeout = forming  # gloo connects every pair here; each collective carries `timeout`
                options._devices = [dist.ProcessGroupGloo.create_device(hostname=self.address)]
                self._pg = dist.ProcessGroupGloo(store, rank, size, options)
            else:
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = timeout
                self._pg = dist.ProcessGroupNCCL(store, rank, size, options)
        except BaseException:
            # A member that never joined (DistStoreError): the raised error's traceback holds this frame, so the store
            # (and on rank 0 its port, listening) lived as long as the error, and the garbage collector then closed the
            # listening descriptor twice, once as the socket and once as the store's server (another thread's file,
            # had it reused the number in between). Release them now, once, as destroy() does.
            store = None
            self.destroy()
            raise

    def _run(self, enqueue: Callable[[], dist.Work], what: str) -> None:
        """Enqueue a collective and wait for it; either failing raises CollectiveError.

        The backend's own errors at enqueue (DistError: NCCL refuses a collective on a communicator aborted by an
        earlier failure, DistBackendError) are the group's fault as much as a failed wait: raised raw, a rollout
        replica took one for the request's own error instead of a replica fault. An argument the backend refuses
        (a plain RuntimeError, ValueError) is the caller's and is raised as it is."""
        try:
            work = enqueue()
        except dist.DistError as e:
            raise self._error(what, e) from e
        try:
            deadline = time.perf_counter() + self.spin_s
            while self.spin_s and not work.is_completed() and time.perf_counter() < deadline:
                os.sched_yield()
            work.wait()
            return
        except RuntimeError as e:
            error = self._error(what, e)
        # A failed work holds the group's connections, and the raised error's traceback would hold this frame: let it
        # go first, so that destroy() closes them at once and the peers still waiting fail now, not at their timeout.
        del work
        raise error

    def _error(self, what: str, cause: RuntimeError) -> CollectiveError:
        """`what`'s failure naming the group, this rank and node, and the first line of the backend's `cause`."""
        first_line = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
        return CollectiveError(
            f"{what} in group {self.name!r} failed on rank {self.rank}/{self.size} at node {self.address} "
            f"(timeout {self.timeout_s:.0f}s): a peer died or stalled. {first_line}"
        )

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor` (same shape and dtype on all ranks), in rank order, on this rank's device.

        A tensor elsewhere is copied there first: NCCL takes only CUDA tensors, and some payloads are built on
        the CPU (cfg.parallel.all_gather_header's version header, before a request's first step)."""
        tensor = tensor.to(self.device).contiguous()
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        options = c10d.AllgatherOptions()
        options.timeout = datetime.timedelta(seconds=self.timeout_s)
        self._run(lambda: self._pg.allgather([out], [tensor], options), "all_gather")
        return out

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """In place: every rank's `tensor` becomes rank `src`'s."""
        options = dist.BroadcastOptions()
        options.rootRank = src
        options.timeout = datetime.timedelta(seconds=self.timeout_s)
        self._run(lambda: self._pg.broadcast([tensor], options), "broadcast")
        return tensor

    def destroy(self) -> None:
        """Release the group's connections (and, on rank 0, the store)."""
        pg, self._pg = self._pg, None
        if pg is not None and hasattr(pg, "shutdown"):
            try:
                pg.shutdown()
            except RuntimeError:
                pass
        self._store = None
        if self._listener is not None:
            # The store's server owns the socket it listens on and closes it when freed: closing it here too
            # would close it twice (EBADF, or another socket that reused the descriptor).
            self._listener.detach()
            self._listener = None


def init_default_group(rendezvous: Rendezvous, rank: int, size: int, device: torch.device | str,
                       timeout_s: float = 300.0) -> None:
    """The process's default group (what FSDP2's device mesh uses), on the node's interface."""
    global _default_store
    bind_collectives_to(node_ip())
    timeout = datetime.timedelta(seconds=timeout_s)
    _default_store = open_store(rendezvous, rank, size, timeout)
    dist.init_process_group(device_backend(device), store=_default_store[0], rank=rank, world_size=size, timeout=timeout)


_default_store: tuple[dist.TCPStore, socket.socket | None] | None = None
"""The default group's store and listening socket, alive as long as the process."""
