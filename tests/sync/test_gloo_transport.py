"""The weight sync over a real gloo group between two Ray actors: bytes arrive bit-identical, and a
dead or silent peer makes the other side fail within its deadline instead of hanging."""

from __future__ import annotations

import time

import pytest
import ray

from skyq.launch.ray_local import local_ray

from . import ray_peers, wire_fixtures
from .ray_peers import ReceiverPeer, SenderPeer, serialized_state

TIMEOUT_S = 3.0


@pytest.fixture(scope="module", autouse=True)
def cluster():
    # The peers live in this test package, which Ray workers cannot import: ship them by value.
    ray.cloudpickle.register_pickle_by_value(ray_peers)
    ray.cloudpickle.register_pickle_by_value(wire_fixtures)
    with local_ray():  # skyq's loopback-only cluster
        yield


def start_pair(timeout_s: float = TIMEOUT_S):
    # num_cpus=0: a killed peer must not leave the next test waiting for its CPU to be released.
    sender = ray.remote(SenderPeer).options(num_cpus=0).remote()
    receiver = ray.remote(ReceiverPeer).options(num_cpus=0).remote()
    port = ray.get(sender.open_store.remote(timeout_s), timeout=30)
    ray.get([sender.join.remote(), receiver.join.remote(port, timeout_s)], timeout=30)
    return sender, receiver


@pytest.fixture(scope="module")
def healthy_pair():
    """One pair shared by the tests that leave it usable (starting actors costs seconds)."""
    return start_pair()


def test_every_wire_dtype_crosses_gloo_bit_identically(healthy_pair):
    sender, receiver = healthy_pair
    for version, seed in ((1, 11), (2, 12)):
        recv_ref = receiver.receive.remote(seed)
        sent = ray.get(sender.sync.remote(seed, version, bucket_bytes=300), timeout=30)
        assert "stats" in sent, sent
        assert ray.get(recv_ref, timeout=30) == {"version": version}
        state = ray.get(receiver.state.remote(), timeout=30)
        assert state["version"] == version
        assert state["tensors"] == serialized_state(seed)
    dtypes = {dtype for dtype, _, _ in state["tensors"].values()}
    assert dtypes == {
        "torch.float8_e4m3fn",
        "torch.float32",
        "torch.uint8",
        "torch.int32",
        "torch.bfloat16",
        "torch.int64",
    }
    assert sent["stats"]["sync/num_buckets"] > 1


def test_engine_killed_mid_sync_fails_the_sender_within_its_deadline():
    sender, receiver = start_pair()
    recv_ref = receiver.receive.remote(1)
    assert "stats" in ray.get(sender.sync.remote(1, 1, bucket_bytes=300), timeout=30)
    ray.get(recv_ref, timeout=30)
    # The engine accepts the manifest, takes two buckets, then its process dies.
    dying = receiver.receive.remote(2, die_on_frame=3)
    start = time.monotonic()
    result = ray.get(sender.sync.remote(2, 2, bucket_bytes=300), timeout=30)
    assert result["error"][0] in ("SyncError", "SyncTimeout"), result
    assert time.monotonic() - start < TIMEOUT_S + 5
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(dying, timeout=30)
    assert ray.get(sender.ping.remote(), timeout=10) > 0  # the trainer side survived


def test_sender_dying_mid_sync_leaves_the_engine_on_its_version():
    sender, receiver = start_pair()
    recv_ref = receiver.receive.remote(5)
    ray.get(sender.sync.remote(5, 1, bucket_bytes=300), timeout=30)
    assert ray.get(recv_ref, timeout=30) == {"version": 1}
    before = ray.get(receiver.state.remote(), timeout=10)
    recv_ref = receiver.receive.remote(6)
    ray.kill(sender)
    result = ray.get(recv_ref, timeout=TIMEOUT_S + 10)
    assert result["error"][0] in ("SyncError", "SyncTimeout"), result
    assert ray.get(receiver.state.remote(), timeout=10) == before


def test_nan_in_trainer_weights_is_refused_naming_the_tensor_and_nothing_is_sent(healthy_pair):
    sender, receiver = healthy_pair
    version = ray.get(receiver.state.remote(), timeout=10)["version"] + 1
    name = "model.layers.0.self_attn.q_proj.weight"
    result = ray.get(sender.sync.remote(7, version, bucket_bytes=300, nan_in=name), timeout=30)
    assert result["error"][0] == "SyncRefused" and f"{name}: 1 NaN" in result["error"][1]
    # Nothing was sent: the engine, asked to receive now, gets the next good sync as its first frame.
    recv_ref = receiver.receive.remote(7)
    assert "stats" in ray.get(sender.sync.remote(7, version, bucket_bytes=300), timeout=30)
    assert ray.get(recv_ref, timeout=30) == {"version": version}
    assert ray.get(receiver.state.remote(), timeout=10)["tensors"] == serialized_state(7)


def test_engine_that_never_receives_fails_the_sender_within_its_deadline(healthy_pair):
    """Runs last on the shared pair: a sync the engine never joins leaves the pair unusable."""
    sender, receiver = healthy_pair
    version = ray.get(receiver.state.remote(), timeout=10)["version"]
    start = time.monotonic()
    result = ray.get(sender.sync.remote(1, version + 1, bucket_bytes=1 << 20), timeout=60)
    assert result["error"][0] == "SyncTimeout", result
    assert time.monotonic() - start < TIMEOUT_S + 5
    assert ray.get(receiver.state.remote(), timeout=10)["version"] == version
