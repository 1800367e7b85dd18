"""A recipe becomes a checked :class:`~rlpad.config.schema.Config`: the YAML file and ``a.b=value``
overrides loaded (load.py), every value checked against its choices and the others (checks.py).
Sits above everything it checks (the registries of algorithms, rollout, lora, parallel, topology);
torch-free, so loading a config never imports torch."""
