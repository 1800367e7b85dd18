"""Code rewards: the policy's programs run against test cases in a bubblewrap sandbox (docs/code.md).

sources.py (the names: verl's code sources, the outcomes), program.py (the program of a response, the
test cases of a ground truth), harness.py (the program's side, inside the sandbox), sandbox.py (one
case in its own sandbox), pool.py (the sandbox workers), verdict.py (verl's comparisons), scorer.py
(a batch of responses -> scores and outcomes), hooks.py (what the reward stage and the run call).
"""
