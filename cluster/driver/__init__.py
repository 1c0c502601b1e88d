"""The control plane: one driver per run steering the rollout, reward and learner pools.

Owns: the run's loop state (`DriverState`: step, the prompt stream's cursors, what is open and
queued), the pools and their placement, which weights version is current and which version each
rollout actor holds, the lease, and what setup started (so teardown stops exactly that). Nothing
outside this package writes them; it holds no group's tensors.
"""
