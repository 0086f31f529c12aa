"""Keep secrets from the environment (API keys, tokens) out of everything a run writes.

A config may legitimately carry a secret, e.g. `trainer.env.WANDB_API_KEY` forwarded to workers;
the workers get the real value, while the saved config, wandb's config and the logs get a marker.
"""

from __future__ import annotations

import os
import re
from typing import Any

SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH", re.IGNORECASE)
"""Environment variable / config key names whose values are treated as secrets."""
MIN_SECRET_LENGTH = 6
"""Shorter values (`1`, `true`) are too common to be recognised as a leaked secret."""


def env_secrets(environ: dict[str, str] | None = None) -> dict[str, str]:
    """{variable name: value} of the environment variables that look like secrets."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items() if SECRET_NAME.search(k) and len(v) >= MIN_SECRET_LENGTH}


def redact(obj: Any, secrets: dict[str, str] | None = None) -> Any:
    """A copy of a plain config tree (dicts, lists, scalars) with every secret replaced by a marker.

    A value under a secret-looking key is replaced whole; any string containing the value of a
    secret environment variable has that value replaced, wherever it appears.
    """
    secrets = env_secrets() if secrets is None else secrets
    if isinstance(obj, dict):
        return {
            key: (
                f"<redacted {key}>"
                if isinstance(key, str) and SECRET_NAME.search(key) and value
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
