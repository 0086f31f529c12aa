"""`CheckpointError`: a checkpoint on disk is unusable as given (names the file or tensor)."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint file, index, config or tensor is missing, corrupt or inconsistent."""
