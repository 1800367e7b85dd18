"""Rewards on the driver: the default, verl 0.9.1's ``default_compute_score`` (verl_default.py); rlpad's
lenient verifier, custom functions and the placement of a score on the last response token
(rules.py); the toy tasks' scorers (toys.py); math-verify's verdict in a child process with a
timeout (math_verifier.py). Imports rlpad.batch, rlpad.functions and, for the toy tasks,
rlpad.embedded."""
