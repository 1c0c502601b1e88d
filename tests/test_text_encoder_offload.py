"""model.text_encoder_offload: the text encoders come to the rollout's device only for an encode
(pure unit test: a module that records where it is sent stands in for a GPU this machine lacks)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from rollout_worker.models.base import park_text_encoders, text_encoders_on


class Recorder(nn.Linear):
    def __init__(self, log: list, name: str):
        super().__init__(2, 2)
        self.log, self.name = log, name

    def to(self, device, *args, **kwargs):  # noqa: D102 — where it went, not a real move
        self.log.append((self.name, str(device)))
        return self


def _pipe(log):
    return SimpleNamespace(text_encoder=Recorder(log, "te"), text_encoder_2=Recorder(log, "te2"),
                           vae=Recorder(log, "vae"))


def test_text_encoders_visit_the_device_only_while_encoding():
    log: list = []
    pipe, gpu = _pipe(log), torch.device("cuda:0")
    park_text_encoders(pipe, gpu, offload=True)
    assert log == [("te", "cpu"), ("te2", "cpu")]  # the VAE stays where the pipeline put it
    log.clear()
    with text_encoders_on(pipe, gpu, offload=True):
        assert log == [("te", "cuda:0"), ("te2", "cuda:0")]
        log.clear()
    assert log == [("te", "cpu"), ("te2", "cpu")]


def test_back_on_the_host_even_when_the_encode_fails():
    log: list = []
    pipe = _pipe(log)
    try:
        with text_encoders_on(pipe, torch.device("cuda:0"), offload=True):
            raise RuntimeError("tokenizer failed")
    except RuntimeError:
        pass
    assert log[-2:] == [("te", "cpu"), ("te2", "cpu")]


def test_nothing_moves_without_offload_or_on_the_cpu():
    log: list = []
    pipe = _pipe(log)
    park_text_encoders(pipe, torch.device("cuda:0"), offload=False)
    with text_encoders_on(pipe, torch.device("cuda:0"), offload=False):
        pass
    park_text_encoders(pipe, torch.device("cpu"), offload=True)
    with text_encoders_on(pipe, "cpu", offload=True):
        pass
    assert log == []
