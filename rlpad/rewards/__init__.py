"""Rewards on the driver: the rule functions, their dispatch by ``data_source`` and the placement of
a score on the last response token (rules.py); math-verify's verdict in a child process with a
timeout (math_verifier.py). Imports rlpad.batch, rlpad.functions and, for the toy tasks,
rlpad.embedded."""
