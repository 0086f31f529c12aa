"""Trainer backends. `skyq.trainer.native`: plain PyTorch over a transformers model (embedded runs)."""
