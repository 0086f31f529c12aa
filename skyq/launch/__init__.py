"""Running skyq: the run directory, Ray actors, the embedded RL driver, metrics, checkpoints."""
