"""torch.distributed transport: a private two-rank group, gloo on CPU and NCCL on GPU (same code).

Rank 0 is the trainer (sender), rank 1 the engine (receiver); both bind to loopback. The group is a standalone
`ProcessGroupGloo`/`ProcessGroupNCCL` built on a TCPStore, not the process's default group, so a
trainer that runs its own torch.distributed world keeps it. The store is created by rank 0 on a
socket it binds to `127.0.0.1`, port 0: the OS picks a free port and the store holds it from then
on, so there is no probe-then-bind race between sibling runs. Gloo's data connections bind to
loopback too (NCCL's bootstrap follows NCCL_SOCKET_IFNAME). Every host wait has the sync deadline:
with gloo each collective is waited on; with NCCL the sender enqueues its frames (stream-ordered, no
host wait) and the host waits, polling, where it needs data: frame headers, the receiver's payload
and the engine's answer, which the sender cannot pass without its frames having gone through.
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from skyq.sync.channel import check_frame_length
from skyq.sync.errors import SyncError, SyncTimeout

LOOPBACK = "127.0.0.1"
SENDER_RANK = 0
RECEIVER_RANK = 1


def open_store(timeout_s: float, host: str = LOOPBACK) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free port of `host` (read it from `.port`).

    TCPStore given a host still listens on every interface; handing it a socket we bound ourselves
    keeps it on `host` (loopback by default).
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen(16)
    port = sock.getsockname()[1]
    # detach(): the store owns the descriptor now; the Python socket must not close it under it.
    return dist.TCPStore(
        host,
        port,
        2,
        True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=sock.detach(),
    )


def connect_store(port: int, timeout_s: float, host: str = LOOPBACK) -> dist.TCPStore:
    """Rank 1's connection to rank 0's store."""
    try:
        return dist.TCPStore(host, port, 2, False, timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, dist.DistError) as exc:
        raise SyncTimeout(
            f"could not reach the weight-sync store at {host}:{port} within {timeout_s} s: {exc}"
        ) from exc


def await_work(work, timeout_s: float, what: str) -> None:
    """Poll a collective's `Work` until it completes, or raise `SyncTimeout` naming `what` once
    `timeout_s` passes. `Work.wait(timeout)` on NCCL polls in whole-millisecond sleeps, a floor on
    every bucket far above a bucket's transfer time over NVLink (docs/benchmarks.md, "Two GPUs
    (issue #7)", the first run); this yields (`sleep(0)`) for the first 2e-3 s, then sleeps 5e-5 s at
    a time."""
    start = time.monotonic()
    deadline = start + timeout_s
    while not work.is_completed():
        now = time.monotonic()
        if now > deadline:
            raise SyncTimeout(
                f"{what}: no transfer between trainer and engine within {timeout_s:g} s "
                "(rollout.weight_sync.timeout_s); is the other side still running?"
            )
        time.sleep(0 if now - start < 2e-3 else 5e-5)


class TorchDistChannel:
    """One end of a two-rank frame channel over broadcast collectives."""

    def __init__(self, store: dist.Store, *, rank: int, timeout_s: float, device: torch.device) -> None:
        if rank not in (SENDER_RANK, RECEIVER_RANK):
            raise ValueError(
                f"weight-sync rank must be {SENDER_RANK} (trainer) or {RECEIVER_RANK} (engine), got {rank}"
            )
        self.rank = rank
        self.peer = 1 - rank
        self.device = torch.device(device)
        self._timeout = timedelta(seconds=timeout_s)
        try:
            if self.device.type == "cuda":
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = self._timeout
                self._group = dist.ProcessGroupNCCL(store, rank, 2, options)
            else:
                options = dist.ProcessGroupGloo._Options()
                options._timeout = self._timeout
                # Bind the data connections to loopback too; gloo's default follows the hostname.
                options._devices = [dist.ProcessGroupGloo.create_device(hostname=LOOPBACK)]
                self._group = dist.ProcessGroupGloo(store, rank, 2, options)
        except (RuntimeError, dist.DistError) as exc:
            raise SyncTimeout(
                f"weight-sync group (rank {rank}) did not form within {timeout_s} s: {exc}. "
                "Did the other actor join? (rollout.weight_sync.timeout_s)"
            ) from exc

    def _broadcast(self, t: Tensor, root: int, what: str, *, host_waits: bool = True) -> None:
        """Broadcast `t` from `root`. On the GPU the host waits (polling, with the deadline) only when
        `host_waits`; otherwise the collective is ordered before the current stream's later work and
        the host goes on: the sender enqueues its frames and meets the deadline at the engine's
        answer, which it must wait for. Gloo always waits, with the deadline."""
        if self._group is None:
            raise SyncError(f"{what}: the weight-sync channel (rank {self.rank}) is closed")
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        try:
            work = self._group.broadcast([t], opts)
            if self.device.type != "cuda":
                work.wait(self._timeout)
                return
            if host_waits:
                await_work(work, self._timeout.total_seconds(), what)
            work.wait()  # the current stream waits for the collective; the host does not
        except (RuntimeError, dist.DistError) as exc:
            # gloo reports both a peer that closed its socket and a passed deadline as RuntimeError.
            kind = SyncTimeout if "imeout" in str(exc) or "imed out" in str(exc) else SyncError
            raise kind(f"{what}: transfer between trainer and engine failed: {exc}") from exc

    def broadcast(self, t: Tensor, root: int, *, host_waits: bool = True) -> None:
        """A plain broadcast of `t` from rank `root` on the channel's group (no frame header): the
        baseline the sync benchmarks compare against."""
        self._broadcast(t, root, f"broadcast of {t.numel() * t.element_size()} bytes", host_waits=host_waits)

    def send_frame(self, payload: Tensor) -> None:
        payload = payload.reshape(-1).to(self.device)
        # Filled on the device: `torch.tensor([n], device=cuda)` is a blocking host-to-device copy,
        # which would make the host wait for every frame queued before this one.
        header = torch.full((1,), payload.numel(), dtype=torch.int64, device=self.device)
        self._broadcast(header, self.rank, "frame header", host_waits=False)
        if payload.numel():
            self._broadcast(
                payload.contiguous(), self.rank, f"frame of {payload.numel()} bytes", host_waits=False
            )

    def recv_frame(self, max_bytes: int, what: str) -> Tensor:
        header = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._broadcast(header, self.peer, f"{what} (header)")
        n = int(header.item())
        check_frame_length(n, max_bytes, what)
        buf = torch.empty(n, dtype=torch.uint8, device=self.device)
        if n:
            self._broadcast(buf, self.peer, what)
        return buf

    def close(self) -> None:
        """Drop the group; its sockets close when the last reference goes."""
        self._group = None
