"""The learner role: policy (LoRA, anchors), losses, advantages, KL, FSDP2, the trainer, the
learner ranks (`LearnerGroup`) and weight publishing.

Owns: the trained weights, the optimizer, the anchors, the KL controller and the checkpoints'
contents. Imports of other roles: `rollout_worker.models` only (it trains the model the rollout
runs).
"""
