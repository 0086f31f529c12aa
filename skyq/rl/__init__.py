"""GRPO and its inputs: tasks and rewards, the shared rollout-batch types, losses and advantages.

Submodules are imported explicitly (`from skyq.rl.grpo import policy_loss`).
"""
