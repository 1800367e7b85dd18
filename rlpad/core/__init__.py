"""The scoring core: padding ops, varlen attention, the packed forward, log-probs, values, model loading."""
