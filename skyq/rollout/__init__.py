"""Rollout engines. `skyq.rollout.embedded.EmbeddedEngine`: in-process PyTorch, wire-format weights."""
