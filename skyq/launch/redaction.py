"""Keep secrets (API keys, tokens, passwords) out of everything a run writes.

A config may legitimately carry a secret, e.g. `trainer.env.WANDB_API_KEY` forwarded to workers;
the workers get the real value, while the saved config, wandb's config and the logs get a marker.

The rules:
- every value of a worker environment (`trainer.env.*`, `rollout.env.*`: any `env` mapping) is a
  secret, whatever its name's case or spelling (`MY_DB_PASS`, `SERVICE_AUTH`, `wandb_api_key`),
  unless its name is on the allow-list of library settings below (`NCCL_DEBUG`,
  `PYTORCH_CUDA_ALLOC_CONF`) and has no secret word in it (`NCCL_...TOKEN` stays secret);
- elsewhere in the config, an environment-variable-style key (UPPER_CASE) with a secret word among
  its parts has its value replaced; lower-case schema fields (`num_key_value_heads`) never match;
- the value of every secret-named variable in the process environment, and of every secret worker
  environment entry, is replaced wherever it appears inside a string, if it is long enough to be a
  credential rather than a word (`disabled`, `1`).
"""

from __future__ import annotations

import os
from typing import Any

SECRET_WORDS = frozenset(
    {"KEY", "APIKEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "PASS", "CREDENTIAL", "CREDENTIALS", "AUTH"}
)
"""Parts of a name (split on `_`, compared upper-case) that mark its value as a secret."""
PUBLIC_ENV_PREFIXES = (
    "CUDA_", "NCCL_", "GLOO_", "TORCH_", "PYTORCH_", "TORCHINDUCTOR_", "TRITON_", "NVTE_", "OMP_", "MKL_",
)  # fmt: skip
"""Worker environment names starting with one of these configure a library and are kept in clear."""
PUBLIC_ENV_NAMES = frozenset(
    {"OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM", "PYTHONPATH", "LD_LIBRARY_PATH", "HF_HUB_OFFLINE"}
)
"""Worker environment names kept in clear besides `PUBLIC_ENV_PREFIXES`."""
ENV_KEY = "env"
"""The config key of a worker environment mapping (`trainer.env`, `rollout.env`)."""
MIN_SECRET_LENGTH = 16
"""Process-environment values shorter than this are not searched for inside strings (too likely a word)."""
MIN_CONFIG_SECRET_LENGTH = 8
"""A secret worker-env value at least this long is also replaced inside other strings of the config."""


def _has_secret_word(name: str) -> bool:
    return not SECRET_WORDS.isdisjoint(name.upper().split("_"))


def is_secret_name(name: str) -> bool:
    """True for environment-variable-style names that hold credentials (`WANDB_API_KEY`)."""
    return name.isupper() and _has_secret_word(name)


def is_public_env_name(name: str) -> bool:
    """True for a worker environment variable on the allow-list (its value is not a secret)."""
    return (name in PUBLIC_ENV_NAMES or name.startswith(PUBLIC_ENV_PREFIXES)) and not _has_secret_word(name)


def split_worker_env(env: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(allow-listed variables, secret variables) of a worker environment."""
    public = {k: v for k, v in env.items() if is_public_env_name(k)}
    return public, {k: v for k, v in env.items() if k not in public}


def env_secrets(environ: dict[str, str] | None = None) -> dict[str, str]:
    """{variable name: value} of the environment variables whose values are redacted in strings."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items() if _has_secret_word(k) and len(v) >= MIN_SECRET_LENGTH}


def config_env_secrets(obj: Any) -> dict[str, str]:
    """{name: value} of the secret entries of every worker environment (`*.env.*`) in a config tree."""
    found: dict[str, str] = {}
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key == ENV_KEY and isinstance(value, dict):
                found.update(
                    (str(k), v)
                    for k, v in value.items()
                    if isinstance(v, str)
                    and not is_public_env_name(str(k))
                    and len(v) >= MIN_CONFIG_SECRET_LENGTH
                )
            else:
                found.update(config_env_secrets(value))
    elif isinstance(obj, list | tuple):
        for value in obj:
            found.update(config_env_secrets(value))
    return found


def redact(obj: Any, secrets: dict[str, str] | None = None) -> Any:
    """A copy of a plain config tree (dicts, lists, scalars) with every secret replaced by a marker."""
    if secrets is None:
        secrets = {**config_env_secrets(obj), **env_secrets()}
    # Longest first: a secret that contains another is replaced whole.
    ordered = dict(sorted(secrets.items(), key=lambda kv: -len(kv[1])))
    return _redact(obj, ordered)


def _redact(obj: Any, secrets: dict[str, str]) -> Any:
    if isinstance(obj, dict):
        out = {}
        for key, value in obj.items():
            if key == ENV_KEY and isinstance(value, dict):
                out[key] = {
                    k: _redact(v, secrets)
                    if is_public_env_name(str(k)) or v in ("", None)
                    else f"<redacted {k}>"
                    for k, v in value.items()
                }
            elif isinstance(key, str) and is_secret_name(key) and value:
                out[key] = f"<redacted {key}>"
            else:
                out[key] = _redact(value, secrets)
        return out
    if isinstance(obj, list | tuple):
        return [_redact(v, secrets) for v in obj]
    if isinstance(obj, str):
        for name, value in secrets.items():
            obj = obj.replace(value, f"<redacted ${name}>")
    return obj
