"""The learner's side of each RL method: one entry per `grpo.loss`, declared in common/methods.py
(`MethodSpec.impl`) and imported when a trainer is built. The trainer picks its method once and
never tests a method's name.

Owns: each method's rows, micro-batching, loss and what it does after a step; the math they call
stays in learner/losses.py, learner/rows.py and learner/nft.py.
"""

from __future__ import annotations

import importlib

from common.methods import method_of
from learner.methods.base import Method


def build_method(cfg) -> Method:
    """The run's method (cfg.grpo.loss), from its declaration's lazy path."""
    module, cls = method_of(cfg).impl.split(":")
    return getattr(importlib.import_module(module), cls)(cfg)
