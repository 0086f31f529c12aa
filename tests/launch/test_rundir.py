"""Run directories: unique, locked, resumable only with a compatible config, no secrets written."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from skyq.launch.redaction import redact
from skyq.launch.rundir import (
    CONFIG_JSON,
    CONFIG_YAML,
    LOCK_FILE,
    RunDirError,
    check_resume_compatible,
    claim_run_dir,
    create_run_dir,
    load_saved_config,
    release_run_dir,
    save_resolved_config,
)

from .run_helpers import compose_config


@pytest.fixture
def container():
    return compose_config(["precision=mxfp8"])[1]


def test_two_runs_started_in_the_same_second_get_different_dirs(tmp_path):
    dirs = {create_run_dir(tmp_path) for _ in range(20)}
    assert len(dirs) == 20 and all(d.is_dir() and d.parent == tmp_path for d in dirs)


def test_a_run_dir_is_claimed_by_one_run_only(tmp_path):
    claim_run_dir(tmp_path, resume=False)
    with pytest.raises(RunDirError, match="in use by another run"):
        claim_run_dir(tmp_path, resume=False)
    with pytest.raises(RunDirError, match="in use by another run"):  # a live holder is never taken over
        claim_run_dir(tmp_path, resume=True)
    release_run_dir(tmp_path)
    claim_run_dir(tmp_path, resume=False)


def test_resume_takes_over_the_lock_of_a_killed_run(tmp_path):
    import socket

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    (tmp_path / LOCK_FILE).write_text(f"{socket.gethostname()} {dead.stdout.strip()}")
    with pytest.raises(RunDirError, match="in use"):
        claim_run_dir(tmp_path, resume=False)
    claim_run_dir(tmp_path, resume=True)
    assert (tmp_path / LOCK_FILE).read_text().endswith(str(__import__("os").getpid()))


def test_saved_config_is_versioned_and_round_trips(tmp_path, container):
    save_resolved_config(tmp_path, container)
    saved = json.loads((tmp_path / CONFIG_JSON).read_text())
    assert saved["format"] == "skyq-config/1" and saved["config_version"] == container["config_version"]
    assert load_saved_config(tmp_path) == redact(container)
    assert "mxfp8" in (tmp_path / CONFIG_YAML).read_text()


def test_saved_config_never_holds_an_env_secret(tmp_path, container, monkeypatch):
    secret = "sk-live-0123456789abcdef"
    monkeypatch.setenv("WANDB_API_KEY", secret)
    monkeypatch.setenv("MY_SERVICE_TOKEN", "tok-98765432100000")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # not a credential: "disabled" stays a word
    container["trainer"]["env"] = {"WANDB_API_KEY": secret, "NCCL_DEBUG": "INFO"}
    # Every worker env value is a secret, whatever its name, unless allow-listed (NCCL_*, ...).
    container["rollout"]["env"] = {
        "MY_DB_PASS": "hunter2-db",
        "SERVICE_AUTH": "bearer-abc",
        "wandb_api_key": "lower-case-key",
        "NCCL_SOCKET_IFNAME": "lo",
        "NCCL_AUTH_TOKEN": "nccl-secret-1",  # allow-listed prefix, secret word: still a secret
    }
    container["task"]["dataset"] = "/data/hunter2-db/train.jsonl"  # a secret inside another value
    container["logger"]["project"] = f"uses {secret} inline"
    container["logger"]["wandb_mode"] = "disabled"
    save_resolved_config(tmp_path, container)
    clear = [secret, "tok-98765432100000", "hunter2-db", "bearer-abc", "lower-case-key", "nccl-secret-1"]
    for name in (CONFIG_JSON, CONFIG_YAML):
        text = (tmp_path / name).read_text()
        assert [s for s in clear if s in text] == [], name
    saved = load_saved_config(tmp_path)
    assert saved["trainer"]["env"] == {"WANDB_API_KEY": "<redacted WANDB_API_KEY>", "NCCL_DEBUG": "INFO"}
    assert saved["rollout"]["env"] == {
        "MY_DB_PASS": "<redacted MY_DB_PASS>",
        "SERVICE_AUTH": "<redacted SERVICE_AUTH>",
        "wandb_api_key": "<redacted wandb_api_key>",
        "NCCL_SOCKET_IFNAME": "lo",
        "NCCL_AUTH_TOKEN": "<redacted NCCL_AUTH_TOKEN>",
    }
    assert saved["task"]["dataset"] == "/data/<redacted $MY_DB_PASS>/train.jsonl"
    assert saved["logger"]["project"] == "uses <redacted $WANDB_API_KEY> inline"
    # Schema fields that merely contain a secret word are config, not secrets.
    assert saved["model"]["num_key_value_heads"] == container["model"]["num_key_value_heads"]
    assert saved["logger"]["wandb_mode"] == "disabled"


def test_resume_refuses_another_runs_config_naming_the_keys(tmp_path, container):
    save_resolved_config(tmp_path, container)
    other = compose_config(["precision=int4_qat", "seed=3"])[1]
    with pytest.raises(
        RunDirError, match=r"precision\.name: run has 'mxfp8', now 'int4_qat'.*seed: run has 0, now 3"
    ):
        check_resume_compatible(tmp_path, other)


def test_resume_may_extend_the_run_and_change_logging(tmp_path, container):
    save_resolved_config(tmp_path, container)
    longer = compose_config(["precision=mxfp8", "algorithm.num_steps=500", "logger=wandb",
                             "checkpoint.save_interval=3", "rollout.weight_sync.timeout_s=9"])[1]  # fmt: skip
    check_resume_compatible(tmp_path, longer)


def test_resume_of_a_dir_that_is_not_a_run_is_refused(tmp_path, container):
    with pytest.raises(RunDirError, match="not a skyq run directory"):
        check_resume_compatible(tmp_path, container)
    (tmp_path / CONFIG_JSON).write_text("{not json")
    with pytest.raises(RunDirError, match="not valid JSON"):
        load_saved_config(tmp_path)
