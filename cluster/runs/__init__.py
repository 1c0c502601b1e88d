"""A run's directory and what it records: metrics.jsonl, media, trackers, the policy files of its
checkpoints, export and the model card.

Owns: the layout of a run directory and every file in it but the checkpoints' contents (the
learner writes those; cluster.driver asks). It never imports cluster.evaluation.
"""
