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


def test_fill_takes_each_tensor_only_when_its_bucket_is_filled():
    state = {f"p{i}": torch.full((4,), float(i)) for i in range(6)}  # 16 B each, 2 per 40 B bucket
    m = W.plan(state, bucket_bytes=40, version=0)
    produced = []

    def gathered():  # what a per-tensor gather looks like to fill
        for e in m.entries:
            produced.append(e.name)
            yield state[e.name]

    for i, bucket in enumerate(W.fill(m, gathered())):
        assert len(produced) == 2 * (i + 1)  # nothing of the next bucket was gathered yet
        assert set(W.bucket_views(m, i, bucket)) == set(produced[-2:])
    with pytest.raises(W.WeightFormatError, match="ended before"):
        list(W.fill(m, iter(list(state.values())[:3])))


def test_fill_in_a_ring_reuses_two_buffers_and_keeps_the_last_two_buckets_whole():
    """ring=2 (the collective sender): two buffers in turn, not fresh memory per bucket; a bucket
    stays intact while the next one is filled (the sender has two in flight)."""
    g = torch.Generator().manual_seed(1)
    state = {f"p{i}": torch.randn(4 + i % 3, generator=g) for i in range(12)}
    state["big"] = torch.randn(40, generator=g)              # alone in its bucket: itself
    m = W.plan(state, bucket_bytes=48, version=0)
    ref = [b.clone() for b in W.fill(m, (state[e.name] for e in m.entries))]
    held, ptrs = [], set()
    for i, bucket in enumerate(W.fill(m, (state[e.name] for e in m.entries), ring=2)):
        held = [*held[-1:], (i, bucket)]                    # two at a time, as the sender holds
        for j, b in held:
            assert torch.equal(b, ref[j]), (i, j)
        if len(m.members(i)) > 1:
            ptrs.add(bucket.untyped_storage().data_ptr())
        else:
            assert bucket.data_ptr() == state[m.members(i)[0].name].data_ptr()
    assert len(m.buckets) >= 6 and len(ptrs) == 2


@pytest.mark.parametrize("alg", ["xxh3", "sums", "blake2b"])
def test_checksum_is_per_tensor_so_bucketing_does_not_change_it(alg):
    state = _state()
    ref = W.checksum(state, alg)
    assert ref.startswith(f"{alg}:")
    for size in (16, 64, 1 << 20):
        m, buckets = W.flatten(state, size, 0)
        views = W.unflatten(m, buckets)
        words = torch.cat([W.digests(W.bucket_views(m, i, b).values(), alg) for i, b in enumerate(buckets)])
        assert W.combine(alg, [(e.name, e.dtype, e.shape) for e in m.entries], words.tolist()) == ref
        W.verify(views, ref)


def test_sums_digest_sees_a_changed_byte_and_a_swap_of_two():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (3 * W.SUMS_WIDTH + 17,), dtype=torch.uint8, generator=g)
    ref = W.digests([x], "sums")
    for i, j in [(5, 5 + W.SUMS_WIDTH), (7, 9), (3 * W.SUMS_WIDTH + 1, 3 * W.SUMS_WIDTH + 16), (0, x.numel() - 1)]:
        y = x.clone()
        y[i], y[j] = x[j], x[i]
        if x[i] != x[j]:
            assert not torch.equal(W.digests([y], "sums"), ref), (i, j)  # a swap of two bytes
        y = x.clone()
        y[i] ^= 1 << (i % 8)
        assert not torch.equal(W.digests([y], "sums"), ref), i  # one flipped bit


def test_checksum_mode_reads_the_older_boolean_form():
    from common.config import WeightSyncConfig

    assert WeightSyncConfig().checksum == "fast"
    assert (WeightSyncConfig(checksum=True).checksum, WeightSyncConfig(checksum=False).checksum) == ("fast", "off")
    assert W.alg_for("fast", "cpu") == "xxh3" and W.alg_for("fast", "cuda") == "sums"
    assert W.alg_for("strong") == "blake2b" and W.alg_for("off") is None
    with pytest.raises(W.ChecksumMismatch, match="does not name its algorithm"):
        W.verify(_state(), "0" * 32)
