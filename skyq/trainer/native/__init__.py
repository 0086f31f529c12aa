"""Native PyTorch trainer: the tiny checkpoint, the precision rewrite and `NativeTrainer`.

Submodules are imported explicitly (`from skyq.trainer.native.trainer import NativeTrainer`).
"""
