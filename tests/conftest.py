"""Shared fixtures: one Ray instance per test session (each start costs seconds)."""

from __future__ import annotations

import os

import pytest
import torch

# Tests share 2 cores: keep every torch process to one thread unless a test says otherwise.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

ROLE_RESOURCES = {"rollout": 8, "reward": 8, "learner": 8}


@pytest.fixture(scope="session")
def ray_session():
    """A real local Ray cluster (token authentication left on), shared by the whole session.

    It declares the three role resources so actors placed by pool find a home.
    """
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=4, resources=dict(ROLE_RESOURCES), include_dashboard=False,
                 log_to_driver=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    yield ray
    ray.shutdown()
