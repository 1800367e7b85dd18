"""The single-controller loop on the driver: one training step as its stages (trainer.py), which
policy version generates each step's batch (async_schedule.py), DAPO's group filter and overlong
shaping (dynamic_sampling.py), trainer checkpoints (checkpoint.py), the engines' first sync when the
actor starts from other weights than model.path (initial_weights.py) and the step metrics and their
loggers (metrics.py). Talks to workers only through ``trainer.Workers``; never imports Ray."""
