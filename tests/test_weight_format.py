"""The weight-sync wire format: bucketing, round trip, checksum, manifest validation."""

from __future__ import annotations

import pytest
import torch

from common import weights as W


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "blocks.0.w": torch.randn(8, 4, generator=g),
        "blocks.0.b": torch.randn(4, generator=g),
        "blocks.1.w": torch.randn(8, 4, generator=g).to(torch.bfloat16),
        "emb": torch.randn(3, 5, 2, generator=g).half(),
        "steps": torch.tensor(7, dtype=torch.int64),          # 0-d
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 3),
    }


def test_round_trip_is_bit_exact_and_buckets_are_dtype_homogeneous():
    state = _state()
    m, buckets = W.flatten(state, bucket_bytes=64, version=5, with_checksum=True)
    assert m.version == 5
    for spec, b in zip(m.buckets, buckets, strict=True):
        assert b.dtype == W.DTYPES[spec.dtype] and b.numel() == spec.numel
        # a bucket exceeds the limit only when it holds a single oversized tensor
        members = [e for e in m.entries if buckets[e.bucket] is b]
        assert spec.nbytes <= 64 or len(members) == 1
    back = W.unflatten(W.Manifest.from_dict(m.to_dict()), buckets)
    assert set(back) == set(state)
    for k, t in state.items():
        assert back[k].dtype == t.dtype and back[k].shape == t.shape
        assert torch.equal(back[k], t), k
    W.verify(back, m.checksum)


def test_small_limit_splits_one_dtype_into_several_buckets():
    state = {f"p{i}": torch.ones(4) * i for i in range(6)}             # 16 B each
    m, buckets = W.flatten(state, bucket_bytes=40, version=0)
    assert [b.numel for b in m.buckets] == [8, 8, 8]
    assert m.nbytes == W.nbytes(state) == 96


def test_checksum_sees_one_flipped_bit_name_and_dtype():
    state = _state()
    ref = W.checksum(state)
    assert W.checksum(dict(reversed(list(state.items())))) == ref     # order-independent
    flipped = dict(state)
    raw = state["blocks.1.w"].clone().view(torch.int16)
    raw.view(-1)[3] ^= 1                                                # one bit of a bf16 value
    flipped["blocks.1.w"] = raw.view(torch.bfloat16)
    assert W.checksum(flipped) != ref
    renamed = dict(state)
    renamed["blocks.0.bias"] = renamed.pop("blocks.0.b")
    assert W.checksum(renamed) != ref
    retyped = dict(state)
    retyped["emb"] = state["emb"].view(torch.bfloat16)                  # same bytes, other dtype
    assert W.checksum(retyped) != ref
    with pytest.raises(W.ChecksumMismatch, match="does not match"):
        W.verify(flipped, ref, who="actor 1")


@pytest.mark.parametrize("corrupt, match", [
    (lambda d: d["entries"][0].update(bucket=99), "bucket 99 does not exist"),
    (lambda d: d["entries"][0].update(offset=10**6), "does not fit"),
    (lambda d: d["buckets"][0].update(dtype="complex32"), "unsupported dtype"),
    (lambda d: d.pop("version"), "malformed"),
    (lambda d: d["entries"].append(dict(d["entries"][0])), "appears twice"),
])
def test_bad_manifest_is_rejected_with_the_field(corrupt, match):
    m, _ = W.flatten(_state(), bucket_bytes=1 << 20, version=1)
    d = m.to_dict()
    corrupt(d)
    with pytest.raises(W.WeightFormatError, match=match):
        W.Manifest.from_dict(d)


def test_unflatten_rejects_buckets_that_do_not_match():
    m, buckets = W.flatten(_state(), bucket_bytes=1 << 20, version=1)
    with pytest.raises(W.WeightFormatError, match="bucket 0"):
        W.unflatten(m, [buckets[0][:-1], *buckets[1:]])
    with pytest.raises(W.WeightFormatError, match="expected"):
        W.unflatten(m, buckets[:-1])
