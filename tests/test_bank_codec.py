"""Codec: bit-exact round trip, clear CorruptEntry on bad input, and a hypothesis fuzz."""

from __future__ import annotations

import uuid

import pytest
import safetensors.torch
import torch
from bank_helpers import HEADS, make_group
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memory_bank.codec import REQUIRED, decode, encode
from memory_bank.errors import CorruptEntry


def _encoded(image: bool = False, dtype=torch.float32):
    grp = make_group(image=image)
    t = grp.members[1]
    t.x, t.x_next, t.final_latents = t.x.to(dtype), t.x_next.to(dtype), t.final_latents.to(dtype)
    eid = uuid.uuid4().hex
    meta, blob = encode(eid, t, HEADS, grp.scores.values[1], float(grp.composite[1]))
    return eid, t, grp, meta, blob


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("image", [False, True])
def test_round_trip_bit_exact(image, dtype):
    eid, t, grp, meta, blob = _encoded(image, dtype)
    # Redis hands back bytes keys and values.
    e = decode({k.encode(): v.encode() for k, v in meta.items()}, blob)
    r = e.trajectory
    assert e.id == eid and r.bank_id == eid and e.status == "fresh"
    for name in ("x", "x_next", "logp_old", "final_latents"):
        a, b = getattr(t, name), getattr(r, name)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name
    if image:
        assert torch.equal(r.condition.image, t.condition.image)
    else:
        assert r.condition.image is None
    assert r.frames is None  # frames are not stored
    assert (r.condition.id, r.condition.prompt) == (t.condition.id, t.condition.prompt)
    for f in ("group_id", "member", "seed", "scheme", "eta", "guidance_scale", "policy_version",
              "sigmas", "step_indices", "trained_times"):
        assert getattr(r, f) == getattr(t, f), f
    assert e.heads == HEADS
    assert torch.equal(e.scores, grp.scores.values[1])
    assert e.composite == float(grp.composite[1])


def test_encode_rejects_non_finite_reward():
    grp = make_group()
    with pytest.raises(ValueError, match="non-finite reward"):
        encode(uuid.uuid4().hex, grp.members[0], HEADS, torch.tensor([1.0, float("nan"), 0.0]), 1.0)


@pytest.mark.parametrize("field", ["x", "version", "scores", "id"])
def test_missing_field_or_tensor_is_named(field):
    _, _, _, meta, blob = _encoded()
    if field == "x":
        t = safetensors.torch.load(blob)
        del t["x"]
        blob = safetensors.torch.save(t)
    else:
        del meta[field]
    with pytest.raises(CorruptEntry, match=field):
        decode(meta, blob)


@pytest.mark.parametrize("tensor,shape,match", [
    ("x", (2, 4, 6, 16, 16), "'x' shape"),                 # K disagrees with step_indices
    ("x_next", (3, 4, 6, 16, 8), "'x_next' shape"),
    ("logp_old", (3, 1), "'logp_old' shape"),
    ("final_latents", (4, 6, 8, 16), "'final_latents' shape"),
])
def test_foreign_shapes_rejected(tensor, shape, match):
    _, _, _, meta, blob = _encoded()
    t = safetensors.torch.load(blob)
    t[tensor] = torch.zeros(shape)
    with pytest.raises(CorruptEntry, match=match):
        decode(meta, safetensors.torch.save(t))


@pytest.mark.parametrize("field,value", [
    ("scheme", "ddim"), ("step_indices", "[0, 99]"), ("scores", "[1.0]"), ("eta", "nan"),
    ("member", "-1"), ("format", "0"), ("sigmas", '["a"]'), ("heads", "{}"),
])
def test_bad_metadata_rejected(field, value):
    _, _, _, meta, blob = _encoded()
    meta[field] = value
    with pytest.raises(CorruptEntry, match=field):
        decode(meta, blob)


def test_pickle_and_garbage_blobs_rejected():
    import pickle

    _, _, _, meta, _ = _encoded()
    for blob in (pickle.dumps({"x": torch.zeros(3)}), b"", b"\x00" * 8, None):
        with pytest.raises(CorruptEntry):
            decode(meta, blob)


# ---- fuzz: nothing but CorruptEntry may escape decode ----------------------------------

_FUZZ = settings(max_examples=200, deadline=None, derandomize=True,
                 suppress_health_check=[HealthCheck.too_slow])
_VALID = _encoded()


def _decode_or_corrupt(meta, blob):
    try:
        decode(meta, blob)
    except CorruptEntry:
        pass


@_FUZZ
@given(st.binary(max_size=4096))
def test_fuzz_random_blob(blob):
    _decode_or_corrupt(_VALID[3], blob)


@_FUZZ
@given(st.data())
def test_fuzz_mutated_blob(data):
    blob = bytearray(_VALID[4])
    # Flip a few bytes, mostly in the header where the JSON and offsets live.
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.integers(0, min(len(blob) - 1, 600)))
        blob[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.sampled_from([len(blob), len(blob) // 2, 9]))
    _decode_or_corrupt(_VALID[3], bytes(blob[:cut]))


_text_or_bytes = st.one_of(st.text(max_size=40), st.binary(max_size=40),
                           st.sampled_from(["1", "-1", "0.5", "nan", "[]", "[1, 2]", '["vq"]',
                                            "1e999", "sage", "fresh", "true", "{}"]))


@_FUZZ
@given(st.dictionaries(st.sampled_from(REQUIRED + ("junk",)), _text_or_bytes, max_size=25),
       st.booleans())
def test_fuzz_random_metadata(overrides, drop):
    meta = dict(_VALID[3])
    meta.update(overrides)
    if drop and overrides:
        meta.pop(next(iter(overrides)))
    _decode_or_corrupt(meta, _VALID[4])


@_FUZZ
@given(st.dictionaries(st.one_of(st.text(max_size=10), st.binary(max_size=10)),
                       _text_or_bytes, max_size=30), st.binary(max_size=256))
def test_fuzz_random_everything(meta, blob):
    _decode_or_corrupt(meta, blob)


def test_blob_format_is_safetensors_both_ways():
    from memory_bank.tensorfile import dumps, loads

    t = {"a": torch.randn(2, 3), "b": torch.randn(4).to(torch.bfloat16),
         "c": torch.arange(6, dtype=torch.uint8).reshape(2, 3), "d": torch.zeros(0, 5)}
    ours = dumps(t)
    for name, v in safetensors.torch.load(ours).items():     # the library reads ours
        assert torch.equal(v, t[name]) and v.dtype == t[name].dtype
    for name, v in loads(safetensors.torch.save(t)).items():  # we read the library's
        assert torch.equal(v, t[name]) and v.dtype == t[name].dtype
    got = loads(ours)
    got["a"].add_(1)                                          # writable, own memory
    assert torch.equal(got["a"], t["a"] + 1)


def test_tensorfile_without_copy_views_the_blob_bytes():
    import numpy as np

    from memory_bank.tensorfile import dumps, loads

    t = {"a": torch.randn(64, 8), "b": torch.arange(10, dtype=torch.int64)}
    blob = dumps(t)
    lo = np.frombuffer(blob, dtype=np.uint8).ctypes.data
    viewed, copied = loads(blob, copy=False), loads(blob)
    for name in t:
        assert torch.equal(viewed[name], t[name]) and torch.equal(copied[name], t[name])
        assert lo <= viewed[name].data_ptr() < lo + len(blob)            # no copy: inside the blob
        assert not lo <= copied[name].data_ptr() < lo + len(blob)
    # a mutable buffer is always copied: its owner could change it under the tensors
    ba = bytearray(blob)
    lo_ba = np.frombuffer(ba, dtype=np.uint8).ctypes.data
    assert not lo_ba <= loads(ba, copy=False)["a"].data_ptr() < lo_ba + len(ba)


@pytest.mark.parametrize("mutate,match", [
    (lambda h: h.update(x={"dtype": "F32", "shape": [10**9], "data_offsets": [0, 4]}), "bytes for shape"),
    (lambda h: h["x"].update(dtype="Q8"), "unknown dtype"),
    (lambda h: h["x"].update(data_offsets=[8, h["x"]["data_offsets"][1] + 8]), "data starts at"),
    (lambda h: h["x"].update(shape=[-1]), "bad shape"),
])
def test_tensorfile_rejects_inconsistent_headers(mutate, match):
    import json

    from memory_bank.tensorfile import loads

    blob = safetensors.torch.save({"x": torch.zeros(3, 4)})
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + n])
    mutate(header)
    h = json.dumps(header).encode()
    with pytest.raises(ValueError, match=match):
        loads(len(h).to_bytes(8, "little") + h + blob[8 + n:])
