"""Which rows go where: rank balancing and token budgets on per-row lengths (balance.py) and the
micro-batch plans of a worker's batch, by rows, by token budget, with shared prompts
(micro_batches.py). Imports rlpad.batch and rlpad.core.shared_prompt only."""
