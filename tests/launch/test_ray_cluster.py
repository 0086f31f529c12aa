"""The embedded run's Ray side: the local cluster listens on loopback only, secret worker env vars
never reach Ray's logs, and every call into an actor has a deadline that names the actor and the call.

One loopback cluster and one trainer/engine actor pair serve the module; the tests that stop the
engine come last."""

from __future__ import annotations

import contextlib
import io
import ipaddress
import os
import signal
import tempfile
import time
import uuid
from pathlib import Path

import psutil
import pytest
import ray

from skyq.launch.actor_pair import SYNC_PEER_GRACE_S, ActorPair
from skyq.launch.deadlines import CALL_TIMEOUT_KEY, WorkerTimeout
from skyq.launch.loop import _starting_checkpoint
from skyq.launch.pair import PairSpec
from skyq.launch.placement import placement_for
from skyq.launch.ray_local import local_ray
from skyq.launch.worker_env import ENV_FILE_PREFIX
from skyq.rl.tokenizer import EOS_ID
from skyq.sync.errors import SyncError

from .run_helpers import compose_config

SYNC_TIMEOUT_S = 2.0
SECRET = f"skyq-db-pass-{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def cluster():
    assert not ray.is_initialized(), "another test module left Ray running"
    with local_ray():
        yield


@pytest.fixture(scope="module")
def pair(cluster, base_overrides):
    cfg, _ = compose_config(
        [*base_overrides, f"+trainer.env.MY_DB_PASS={SECRET}", "+rollout.env.NCCL_DEBUG=WARN",
         f"rollout.weight_sync.timeout_s={SYNC_TIMEOUT_S}"]
    )  # fmt: skip
    placement = placement_for(cfg.topology, cfg.rollout.weight_sync.transport)
    spec = PairSpec(
        model=cfg.model,
        precision=cfg.precision,
        algorithm=cfg.algorithm,
        trainer=cfg.trainer,
        rollout=cfg.rollout,
        placement=placement,
        checkpoint_path=_starting_checkpoint(cfg.model, cfg.task, cfg.checkpoint, placement.device),
        seed=cfg.seed,
        eos_token_id=EOS_ID,
    )
    printed = io.StringIO()
    # Hand-over files of other runs on this machine (a killed driver cannot clean up) are not this pair's.
    others = set(Path(tempfile.gettempdir()).glob(f"{ENV_FILE_PREFIX}*"))
    with contextlib.redirect_stdout(printed):
        built = ActorPair(spec)
    built.other_env_files = others
    built.startup_lines = printed.getvalue().splitlines()
    yield built
    built.shutdown()


def in_actor(actor, fn):
    return ray.get(actor.__ray_call__.remote(lambda self: fn()), timeout=60)


def listening(proc: psutil.Process) -> list[tuple[str, str]]:
    try:
        return [
            (proc.name(), c.laddr.ip) for c in proc.net_connections("inet") if c.status == psutil.CONN_LISTEN
        ]
    except psutil.NoSuchProcess:
        return []


def test_the_local_cluster_listens_on_loopback_only(pair):
    driver = psutil.Process()
    procs = [driver, *driver.children(recursive=True)]
    names = {p.name() for p in procs if p.is_running()}
    assert {"gcs_server", "raylet"} <= names, names  # the cluster's own processes, not just the driver
    sockets = [s for p in procs for s in listening(p)]
    assert any(name == "raylet" for name, _ in sockets), sockets
    # gcs, raylet, the runtime-env agent, the driver's and each actor's gRPC server
    exposed = [
        (name, ip) for name, ip in sockets if not ipaddress.ip_address(ip.removeprefix("::ffff:")).is_loopback
    ]
    assert exposed == [], f"Ray listens beyond loopback: {exposed}"
    assert in_actor(pair.trainer, ray.util.get_node_ip_address) == "127.0.0.1"


def test_actor_start_up_prints_one_line_per_phase(pair):
    lines = pair.startup_lines
    assert lines[0].startswith("start-up: placement group of 2 bundle(s) ready in ")
    assert lines[1] == "start-up: starting the trainer and engine actors (model build, engine boot)"
    assert sorted(line.split(" ready after ")[0] for line in lines[2:4]) == [
        "start-up: engine actor",
        "start-up: trainer actor",
    ]
    assert any("(model build " in line for line in lines) and any("(engine boot " in line for line in lines)
    assert lines[4].startswith("start-up: weight-sync group formed in ") and len(lines) == 5


def test_secret_worker_env_reaches_the_actor_but_not_rays_logs(pair):
    assert in_actor(pair.trainer, lambda: os.environ.get("MY_DB_PASS")) == SECRET
    assert in_actor(pair.engine, lambda: os.environ.get("NCCL_DEBUG")) == "WARN"  # allow-listed: runtime_env
    assert in_actor(pair.engine, lambda: os.environ.get("MY_DB_PASS")) is None  # the trainer's only
    session = Path(ray._private.worker._global_node.get_session_dir_path())
    files = [p for p in session.rglob("*") if p.is_file() and not p.is_socket()]
    assert any(p.name == "runtime_env_agent.log" for p in files)  # where Ray logs runtime_env in clear
    leaked = [str(p) for p in files if SECRET.encode() in p.read_bytes()]
    assert leaked == []
    # the owner-only hand-over file is gone once the actors are up
    assert not set(Path(tempfile.gettempdir()).glob(f"{ENV_FILE_PREFIX}*")) - pair.other_env_files


def test_a_stopped_engine_fails_generate_at_its_deadline_naming_actor_and_call(pair):
    os.kill(in_actor(pair.engine, os.getpid), signal.SIGSTOP)  # a wedged engine: alive, never answers
    pair.call_timeout_s = 3.0
    start = time.monotonic()
    with pytest.raises(WorkerTimeout) as failure:
        pair.generate([[1, 2, 3]], n=1, max_new_tokens=2, temperature=1.0, top_p=1.0, seed=0)
    assert time.monotonic() - start < 3.0 + 5
    assert str(failure.value).startswith(
        f"engine actor: generate did not return within 3 s ({CALL_TIMEOUT_KEY})"
    )


def test_a_sync_with_a_stopped_engine_ends_soon_after_the_sync_deadline(pair):
    """The trainer's transfer times out after rollout.weight_sync.timeout_s; the driver then waits
    only SYNC_PEER_GRACE_S for the silent engine's side (the engine is still SIGSTOPped)."""
    pair.call_timeout_s = 600.0
    start = time.monotonic()
    with pytest.raises(SyncError) as failure:
        pair.sync(1)
    took = time.monotonic() - start
    assert took < SYNC_TIMEOUT_S + SYNC_PEER_GRACE_S + 5, f"the failing sync took {took:.1f} s"
    message = str(failure.value)
    assert "weight sync of version 1 failed. trainer: SyncTimeout" in message, message
    assert f"engine: no answer within {SYNC_PEER_GRACE_S:.0f} s" in message, message
