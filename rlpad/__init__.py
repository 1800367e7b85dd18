"""rlpad: GRPO/PPO post-training for Hugging Face causal LMs with exact remove-padding.

The library (this package) never imports Ray; ``workers/`` holds the Ray actors.
Entry points: ``rlpad.core.forward.compute_log_probs`` (padded or packed log-probs and entropies),
``rlpad.train`` (``python -m rlpad.train --config recipes/grpo_tiny.yaml``), ``rlpad`` (CLI).
"""

__version__ = "0.1.0"
