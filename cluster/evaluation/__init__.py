"""Evaluation: the fixed evaluation pairs (`EvalSet`), sampling and scoring them on the rollout
pool or in one process, the evaluation curve and the before/after pictures.

Owns: evaluation results and what the run directory shows of them (it writes through
cluster.runs); it imports cluster.runs, never the reverse.
"""
