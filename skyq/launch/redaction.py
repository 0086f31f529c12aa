"""Keep secrets from the environment (API keys, tokens) out of everything a run writes.

A config may legitimately carry a secret, e.g. `trainer.env.WANDB_API_KEY` forwarded to workers;
the workers get the real value, while the saved config, wandb's config and the logs get a marker.

Two rules, both narrow so that ordinary settings survive untouched:
- an environment-variable-style key (UPPER_CASE) with a secret word among its parts
  (`WANDB_API_KEY`, `HF_TOKEN`, `AWS_SECRET_ACCESS_KEY`) has its value replaced, wherever it sits;
  lower-case schema fields (`num_key_value_heads`) never match;
- the value of every such variable in the process environment is replaced wherever it appears in
  a string, if it is long enough to be a credential rather than a word (`disabled`, `1`).
"""

from __future__ import annotations

import os
from typing import Any

SECRET_WORDS = frozenset(
    {"KEY", "APIKEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "CREDENTIALS"}
)
"""Parts of an UPPER_CASE name (split on `_`) that mark its value as a secret."""
MIN_SECRET_LENGTH = 16
"""Environment values shorter than this are not searched for inside strings (too likely a word)."""


def is_secret_name(name: str) -> bool:
    """True for environment-variable-style names that hold credentials (`WANDB_API_KEY`)."""
    return name.isupper() and not SECRET_WORDS.isdisjoint(name.split("_"))


def env_secrets(environ: dict[str, str] | None = None) -> dict[str, str]:
    """{variable name: value} of the environment variables whose values are redacted in strings."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items() if is_secret_name(k) and len(v) >= MIN_SECRET_LENGTH}


def redact(obj: Any, secrets: dict[str, str] | None = None) -> Any:
    """A copy of a plain config tree (dicts, lists, scalars) with every secret replaced by a marker."""
    secrets = env_secrets() if secrets is None else secrets
    if isinstance(obj, dict):
        return {
            key: (
                f"<redacted {key}>"
                if isinstance(key, str) and is_secret_name(key) and value
                else redact(value, secrets)
            )
            for key, value in obj.items()
        }
    if isinstance(obj, list | tuple):
        return [redact(v, secrets) for v in obj]
    if isinstance(obj, str):
        for name, value in secrets.items():
            obj = obj.replace(value, f"<redacted ${name}>")
    return obj
