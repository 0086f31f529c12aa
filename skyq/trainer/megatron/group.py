"""The ranks of one Megatron world, driven as one: rank 0 in the worker's process, the others as
Ray actors it starts.

`RankGroup.call(method, ...)` runs `MegatronTrainer.<method>` on every rank at once (every such call
is a collective) and returns rank 0's result with the others'. Rank 0 runs on one dedicated thread
of the worker (all its Megatron work on the same thread), while this thread watches every rank: the
first error, rank 0's or a peer's, is raised at once naming its rank, instead of rank 0 waiting in a
collective for a peer that has died. The world's collectives are bounded by its process-group
timeout (`timeout_s`), so a rank left waiting by a failed peer gives up too.

Where the peers go: when this process's worker was started from the run's placement plan
(`skyq.launch.probe.actor_placement`), rank r is placed as the plan places trainer rank r (its
bundle of the plan's placement group, its GPU fraction or CPU share, the plan's env merged under
the backend's own), so every rank of the world sits where the plan printed it. A world built
outside a planned run (a test's, the driver's) places its peers with `peer_options` alone.
"""

from __future__ import annotations

import socket
from concurrent.futures import Future, ThreadPoolExecutor, wait
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from skyq.trainer.megatron.trainer import MegatronTrainer

PEER_CLOSE_TIMEOUT_S = 10.0
"""How long a peer's `close` may take before the peer is killed regardless."""

_POLL_S = 0.05


class MegatronRankError(RuntimeError):
    """A call failed on one rank of the Megatron world (the message names the rank)."""


def open_world_store(world_size: int, timeout_s: float, host: str = "127.0.0.1") -> dist.TCPStore:
    """Rank 0's rendezvous store of the world on a free port of `host` (held from now on: no
    probe-then-bind race), as `skyq.sync.torch_dist.open_store` does for the sync groups."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen(world_size)
    return dist.TCPStore(
        host,
        sock.getsockname()[1],
        world_size,
        True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=sock.detach(),
    )


class MegatronRank:
    """Rank r > 0 of the world (a Ray actor): a `MegatronTrainer` joined to rank 0's store."""

    def __init__(
        self,
        *,
        store_port: int,
        world_size: int,
        timeout_s: float,
        env_file: str | None = None,
        **trainer_kwargs: Any,
    ) -> None:
        """`env_file`: the trainer's secret environment variables, handed over as the driver hands
        them to rank 0 (`skyq.launch.worker_env`: an owner-only file, never Ray's logged runtime_env),
        set before anything is built."""
        from skyq.launch.worker_env import apply_env_file

        apply_env_file(env_file)
        store = dist.TCPStore(
            "127.0.0.1", store_port, world_size, False, timeout=timedelta(seconds=timeout_s)
        )
        self.trainer = MegatronTrainer(
            store=store, world_size=world_size, timeout_s=timeout_s, **trainer_kwargs
        )

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """`MegatronTrainer.<method>` on this rank."""
        return getattr(self.trainer, method)(*args, **kwargs)

    def ready(self) -> bool:
        """True once constructed (a call that surfaces the constructor's error)."""
        return True

    def missing_env(self, names: list[str]) -> list[str]:
        """Which of `names` this rank's process lacks (rank 0 checks its secret variables arrived)."""
        import os

        return [name for name in names if name not in os.environ]

    def drain_weights(self) -> int:
        """Take part in one weight export (a collective) and drop what it yields; the tensor count."""
        return sum(1 for _ in self.trainer.hf_weights())

    def close(self) -> None:
        self.trainer.close()


def rank_options(peer_options: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """Ray options of peer `rank`: the plan's for trainer rank `rank` when this process was started
    from a placement plan (its env merged with `peer_options`' own), else `peer_options`."""
    from skyq.launch.plan import TRAINER
    from skyq.launch.probe import actor_placement

    started = actor_placement()
    if started is None:
        return dict(peer_options)
    planned = len(started.plan.trainer)
    if planned != world_size:
        raise MegatronRankError(
            f"the Megatron world has {world_size} ranks but the placement plan places {planned} trainer "
            "rank(s): topology.parallel and topology.trainer_gpus disagree with the world"
        )
    options = {**peer_options, **started.actor_options(TRAINER, rank)}
    env = {
        **peer_options.get("runtime_env", {}).get("env_vars", {}),
        **options.get("runtime_env", {}).get("env_vars", {}),
    }
    options.pop("runtime_env", None)
    if env:
        options["runtime_env"] = {"env_vars": env}
    return options


class RankGroup:
    """Rank 0's `MegatronTrainer` plus the peer actors of ranks 1 .. world_size - 1."""

    def __init__(
        self,
        *,
        world_size: int,
        timeout_s: float,
        peer_options: dict[str, Any],
        trainer_kwargs: dict[str, Any],
        secret_env_names: tuple[str, ...] = (),
    ) -> None:
        """Start the peers, then build rank 0 while they build theirs (they meet in
        init_process_group). `peer_options`: the Ray options of each peer actor. `secret_env_names`:
        the trainer's secret variables (set in this process by the driver's env file): each peer gets
        them through its own owner-only file, and start-up fails if one did not arrive."""
        self.world_size = world_size
        self.peers: list[Any] = []
        self._env_files: list = []
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megatron-rank0")
        self.trainer: MegatronTrainer | None = None
        store = open_world_store(world_size, timeout_s)
        self._store = store  # rank 0 holds the world's store for the world's lifetime
        try:
            if world_size > 1:
                import os

                import ray

                from skyq.launch.worker_env import write_env_file

                secret = {name: os.environ[name] for name in secret_env_names if name in os.environ}
                actor = ray.remote(MegatronRank)
                for r in range(1, world_size):
                    env_file = write_env_file(secret, f"megatron-rank{r}")
                    self._env_files.append(env_file)
                    self.peers.append(
                        actor.options(**rank_options(peer_options, r, world_size)).remote(
                            rank=r,
                            store_port=store.port,
                            world_size=world_size,
                            timeout_s=timeout_s,
                            env_file=None if env_file is None else str(env_file),
                            **trainer_kwargs,
                        )
                    )
            local = self._thread.submit(
                lambda: MegatronTrainer(
                    rank=0, store=store, world_size=world_size, timeout_s=timeout_s, **trainer_kwargs
                )
            )
            # A method call on each peer surfaces its constructor's error.
            self.trainer, _ = self._wait(local, [p.ready.remote() for p in self.peers], "start-up")
            if secret_env_names and self.peers:
                import ray

                for rank, missing in enumerate(
                    ray.get([p.missing_env.remote(list(secret_env_names)) for p in self.peers]), 1
                ):
                    if missing:
                        raise MegatronRankError(
                            f"rank {rank} of {world_size}: the trainer's secret variables {missing} did not reach it"
                        )
        except BaseException:
            self.close()
            raise
        finally:
            from skyq.launch.worker_env import remove_env_file

            for path in self._env_files:  # the peers deleted theirs on start; a failed start leaves none
                remove_env_file(path)

    def call(self, method: str, *args: Any, **kwargs: Any) -> tuple[Any, list[Any]]:
        """`MegatronTrainer.<method>(*args, **kwargs)` on every rank at once: (rank 0's result,
        the peers' results in rank order)."""
        refs = [p.call.remote(method, *args, **kwargs) for p in self.peers]
        return self._wait(self._thread.submit(getattr(self.trainer, method), *args, **kwargs), refs, method)

    def run_with_peers(self, local: Any, peer_method: str, what: str) -> tuple[Any, list[Any]]:
        """`local()` on rank 0's thread while every peer runs its own `peer_method` (e.g. draining
        the collective export rank 0 consumes)."""
        refs = [getattr(p, peer_method).remote() for p in self.peers]
        return self._wait(self._thread.submit(local), refs, what)

    def _wait(self, local: Future, refs: list[Any], what: str) -> tuple[Any, list[Any]]:
        """Wait for rank 0's future and every peer's ref; the first error raises, naming its rank."""
        pending = dict(zip(refs, range(1, len(refs) + 1)))
        results: dict[int, Any] = {}
        while pending or not local.done():
            if local.done():
                self._raise_if_failed(local, what)
            if not pending:
                wait([local], timeout=_POLL_S)
                continue
            import ray

            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=_POLL_S)
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    results[rank] = ray.get(ref)
                except Exception as exc:
                    cause = getattr(exc, "cause", None) or exc
                    raise MegatronRankError(
                        f"rank {rank} of {self.world_size}: {what} failed: {type(cause).__name__}: {cause}"
                    ) from exc
        self._raise_if_failed(local, what)
        return local.result(), [results[r] for r in range(1, self.world_size)]

    def _raise_if_failed(self, local: Future, what: str) -> None:
        exc = local.exception()
        if exc is not None:
            raise MegatronRankError(
                f"rank 0 of {self.world_size}: {what} failed: {type(exc).__name__}: {exc}"
            ) from exc

    def close(self) -> None:
        """Every rank leaves the world (bounded), then the peers are killed."""
        if self.peers:
            import ray

            refs = [p.close.remote() for p in self.peers]
            if self.trainer is not None:
                self._thread.submit(self.trainer.close)
            try:
                ray.get(refs, timeout=PEER_CLOSE_TIMEOUT_S)
            except Exception:  # a dead or stuck peer is killed all the same
                pass
            for peer in self.peers:
                ray.kill(peer)
            self.peers = []
        elif self.trainer is not None:
            wait([self._thread.submit(self.trainer.close)], timeout=PEER_CLOSE_TIMEOUT_S)
        self.trainer = None
        self._thread.shutdown(wait=False)
