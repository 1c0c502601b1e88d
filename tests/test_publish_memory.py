"""What learner rank 0 holds at a publish: the payload streams one bucket at a time in the
rollout's dtype (learner/weight_sync.stream_tensors, put_stream), not the fp32 payload plus a
packed copy of it; `vgrpo plan`'s host term for it is that bucket (cluster/plan/host.py).

Counted as tensor storage allocated and alive (common/tensor_bytes.py), the figure the plan's
terms predict."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import ray
import torch

from common.config import load_config
from common.tensor_bytes import LiveTensorBytes
from learner.weight_sync import put_stream, stream_tensors

ROOT = Path(__file__).resolve().parents[1]
N, ROWS, COLS = 16, 256, 1024          # 16 weights of 1 MiB fp32 each


def test_an_object_store_publish_holds_one_bucket_in_the_wire_dtype(ray_session):
    gen = torch.Generator().manual_seed(0)
    tensors = {f"w{i:02d}": torch.randn(ROWS, COLS, generator=gen) for i in range(N)}
    wire = {k: torch.bfloat16 for k in tensors}
    one = ROWS * COLS * 2               # one weight on the wire
    bucket = 4 * one                    # 4 weights per bucket: 4 buckets in all
    with LiveTensorBytes() as live:
        record = put_stream(stream_tensors(tensors, wire, bucket, version=3), "fast")
    payload = N * one
    # one bucket and the weight being cast into the next; far below the payload (the old
    # publish held the fp32 payload and a packed copy: 2 x 4 x payload / 2)
    assert live.peak <= bucket + one, (live.peak, bucket)
    assert live.peak >= one             # the probe sees the casts
    m = record.weights.manifest
    assert len(m["buckets"]) == 4
    # and what went into the object store is the payload in bf16, bit for bit
    sent = [a for ref in record.weights.refs for a in ray.get(ref)]
    assert sum(a.nbytes for a in sent) == payload
    got = torch.from_numpy(np.concatenate([a.reshape(-1) for a in sent]).view(np.int16)).view(torch.bfloat16)
    want = torch.cat([tensors[k].to(torch.bfloat16).reshape(-1) for k in sorted(tensors)])
    assert torch.equal(got, want)


@pytest.mark.parametrize("transport, expect", [("object_store", "bucket"), ("collective", "none")])
def test_the_plan_counts_one_bucket_on_rank_0s_host_at_a_publish(transport, expect):
    from cluster.plan.host import host_ram
    from cluster.plan.sizing import plan
    from cluster.plan.timing import payload_bytes

    cfg = load_config(ROOT / "configs/wan22_i2v_tagrpo.yaml", [f"weight_sync.transport={transport}"])
    p = plan(cfg, "H100")
    held = host_ram(cfg, p)["learner"]["rank 0 at a publish (one bucket)"]
    largest = 2 * p.arch.largest_params          # bf16 on the wire
    assert payload_bytes(cfg, p) == pytest.approx(2 * p.arch.params * p.arch.trained_experts)
    if expect == "none":                         # broadcast from the GPU
        assert held == 0
    else:
        assert held == max(cfg.weight_sync.bucket_bytes, largest) < payload_bytes(cfg, p) / 50
