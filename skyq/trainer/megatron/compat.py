"""The one place that knows which megatron-core versions skyq runs, and what their configs accept.

Supported: 0.16.1 (the CPU pin: the last release for CI's Python 3.11, no Transformer Engine) and
0.19.2 (the GPU box, Python 3.12, with Transformer Engine 2.20.2). skyq builds its
`TransformerConfig` from keyword arguments; a field the installed version lacks (renamed or removed
in a release skyq was not checked against) fails here by name instead of as a TypeError deep in
the dataclass, and a version outside the list fails before anything is built.
"""

from __future__ import annotations

import dataclasses
from typing import Any

SUPPORTED_VERSIONS: dict[tuple[int, int, int], str] = {
    (0, 16, 1): "CPU (CI, Python 3.11, no Transformer Engine)",
    (0, 19, 2): "GPU (Python 3.12, Transformer Engine 2.20.2)",
}


class MegatronVersionError(RuntimeError):
    """The installed megatron-core is not a version skyq supports, or lacks a config field."""


def installed_version() -> tuple[int, int, int]:
    """(major, minor, patch) of the installed megatron-core."""
    from megatron.core import package_info

    return (int(package_info.MAJOR), int(package_info.MINOR), int(package_info.PATCH))


def check_version() -> tuple[int, int, int]:
    """The installed version, or MegatronVersionError naming the supported ones."""
    version = installed_version()
    if version not in SUPPORTED_VERSIONS:
        supported = ", ".join(f"{'.'.join(map(str, v))} ({where})" for v, where in SUPPORTED_VERSIONS.items())
        raise MegatronVersionError(
            f"megatron-core {'.'.join(map(str, version))} is installed; trainer=megatron supports {supported}. "
            "Install one of them (pip install 'megatron-core==0.16.1' on the CPU)"
        )
    return version


def build_config(cls: type, kwargs: dict[str, Any]) -> Any:
    """`cls(**kwargs)` after checking every key is a dataclass field of the installed `cls`."""
    fields = {f.name for f in dataclasses.fields(cls)}
    missing = sorted(set(kwargs) - fields)
    if missing:
        raise MegatronVersionError(
            f"megatron-core {'.'.join(map(str, installed_version()))}: {cls.__name__} has no field(s) "
            f"{missing}, which skyq sets; this version is not one skyq was checked against "
            f"(supported: {sorted('.'.join(map(str, v)) for v in SUPPORTED_VERSIONS)})"
        )
    return cls(**kwargs)
