"""Codec: bit-exact round trip, clear CorruptEntry on bad input, and a hypothesis fuzz."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import uuid

import pytest
import safetensors.torch
import torch
import xxhash
from bank_helpers import HEADS, make_cond, make_group
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.sde import SCHEMES as SCHEME_CLASSES
from common.sde import SchemeSpec
from common.types import Cond, Condition, Trajectory
from memory_bank.codec import (
    REQUIRED,
    SCHEMES,
    cond_nbytes,
    decode,
    decode_cond,
    encode,
    encode_cond,
)
from memory_bank.errors import CorruptEntry
from memory_bank.tensorfile import dumps


def _tensors(blob: bytes) -> dict[str, torch.Tensor]:
    """A blob's tensors, read by the safetensors library (our checksum is its metadata)."""
    return safetensors.torch.load(blob)

CK = "0123456789abcdef" * 2   # a condition record's key (32 hex characters)


def _encoded(image: bool = False, dtype=torch.float32):
    grp = make_group(image=image)
    t = grp.members[1]
    t.x, t.x_next, t.final_latents = t.x.to(dtype), t.x_next.to(dtype), t.final_latents.to(dtype)
    eid = uuid.uuid4().hex
    meta, blob = encode(eid, t, HEADS, grp.scores.values[1], float(grp.composite[1]), cond_key=CK)
    return eid, t, grp, meta, bytes(blob)      # as Redis stores it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("image", [False, True])
def test_round_trip_bit_exact(image, dtype):
    """An entry carries the member's trained steps and its condition record's key; the first
    frame (I2V) and any file path are not part of it (the condition's encoding is)."""
    eid, t, grp, meta, blob = _encoded(image, dtype)
    # Redis hands back bytes keys and values.
    e = decode({k.encode(): v.encode() for k, v in meta.items()}, blob)
    r = e.trajectory
    assert e.id == eid and r.bank_id == eid and e.status == "fresh"
    for name in ("x", "x_next", "logp_old", "final_latents"):
        a, b = getattr(t, name), getattr(r, name)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name
    assert r.condition.image is None and r.condition.image_path is None and "image" not in meta
    assert e.cond_key == CK and r.cond is None   # the bank sets cond from the record
    assert r.frames is None  # frames are not stored
    assert (r.condition.id, r.condition.prompt) == (t.condition.id, t.condition.prompt)
    for f in ("group_id", "member", "seed", "spec", "guidance_scale", "policy_version",
              "step_indices", "trained_times"):
        assert getattr(r, f) == getattr(t, f), f
    assert meta["scheme"] == "sage" and json.loads(meta["scheme_params"]) == {"eta": 0.5, "clamp_c": 3e-3}
    assert e.heads == HEADS
    assert torch.equal(e.scores, grp.scores.values[1])
    assert e.composite == float(grp.composite[1])


def test_encode_rejects_non_finite_reward():
    grp = make_group()
    with pytest.raises(ValueError, match="non-finite reward"):
        encode(uuid.uuid4().hex, grp.members[0], HEADS, torch.tensor([1.0, float("nan"), 0.0]), 1.0,
               cond_key=CK)


@pytest.mark.parametrize("field", ["x", "version", "scores", "id"])
def test_missing_field_or_tensor_is_named(field):
    _, _, _, meta, blob = _encoded()
    if field == "x":
        t = _tensors(blob)
        del t["x"]
        blob = dumps(t)
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
    t = _tensors(blob)
    t[tensor] = torch.zeros(shape)
    with pytest.raises(CorruptEntry, match=match):
        decode(meta, dumps(t))


@pytest.mark.parametrize("field,value", [
    ("scheme", "ddim"), ("step_indices", "[0, 99]"), ("scores", "[1.0]"),
    ("member", "-1"), ("format", "0"), ("sigmas", '["a"]'), ("heads", "{}"),
    ("step_indices", "[1, 0, 2]"), ("cond_key", "x" * 32),
    ("scheme_params", '{"eta": NaN, "clamp_c": 0.003}'),
    ("scheme_params", '{"eta": 0.5}'),                     # clamp_c missing: no default is guessed
    ("scheme_params", '{"clamp_c": 0.003, "eta": 0.5}'),   # not in the order encode writes
    ("scheme_params", '{"eta": 0.5, "clamp_c": 3e-3}'),    # not the number as encode writes it
    ("scheme_params", '{"eta": 1, "clamp_c": 0.003}'),
    ("scheme_params", '{"eta": "0.5", "clamp_c": 0.003}'),
    ("scheme_params", '[0.5, 0.003]'),
    ("scheme", "flow"),                                    # sage's arguments under another name
])
def test_bad_metadata_rejected(field, value):
    _, _, _, meta, blob = _encoded()
    meta[field] = value
    with pytest.raises(CorruptEntry, match=field):
        decode(meta, blob)


def test_entry_of_format_1_is_refused_in_one_line():
    """Format 1 stored the scheme's name and η only; the other arguments came from the learner's
    config, so such an entry cannot be replayed exactly: it is refused, not guessed at."""
    _, _, _, meta, blob = _encoded()
    old = {k: v for k, v in meta.items() if k not in ("scheme_params", "cond_key")}
    old.update(format="1", eta="0.5")
    with pytest.raises(CorruptEntry) as e:
        decode(old, blob)
    assert str(e.value) == ("field 'format' is '1': an entry of an older vgrpo, which did not store its "
                            "SDE scheme's full spec, so it cannot be replayed exactly; it is not read "
                            "(format 3 is)")


def test_entry_of_format_2_is_refused_in_one_line():
    """Format 2 stored every recorded step and no encoded condition (the learner re-encoded the
    prompt and opened the image path): without an encoder it cannot be trained, so it is refused."""
    _, _, _, meta, blob = _encoded()
    old = {k: v for k, v in meta.items() if k != "cond_key"}
    old.update(format="2", image_path="/data/first.png", trained_steps="[0, 1]")
    with pytest.raises(CorruptEntry) as e:
        decode(old, blob)
    assert str(e.value) == ("field 'format' is '2': an entry of an older vgrpo, which stored no encoded "
                            "condition (the learner re-encoded it from the prompt and an image path); "
                            "it is not read (format 3 is)")
    assert "\n" not in str(e.value)


# ---- encoded conditions ---------------------------------------------------------------------


def _cond(dtype=torch.bfloat16) -> Cond:
    gen = torch.Generator().manual_seed(7)
    return Cond({"encoder_hidden_states": torch.randn(1, 6, 8, generator=gen).to(dtype),
                 "encoder_attention_mask": torch.tensor([[1, 1, 1, 0, 0, 0]], dtype=torch.int64),
                 "condition": torch.randn(1, 8, 3, 2, 2, generator=gen).to(dtype)},
                {"encoder_hidden_states": torch.randn(1, 6, 8, generator=gen).to(dtype),
                 "encoder_attention_mask": torch.ones(1, 6, dtype=torch.int64)}, "wan-fingerprint")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_condition_record_round_trip_bit_exact(dtype):
    c = _cond(dtype)
    key, fields = encode_cond("cond-α", c)
    raw = {k.encode(): v if isinstance(v, bytes) else v.encode() for k, v in fields.items()}  # as Redis returns
    got_key, cid, got = decode_cond(raw)
    assert (got_key, cid, got.encoder) == (key, "cond-α", "wan-fingerprint")
    for side in ("tensors", "uncond"):
        a, b = getattr(c, side), getattr(got, side)
        assert set(a) == set(b)
        for n in a:
            assert _same(a[n], b[n]), (side, n)
    assert cond_nbytes(fields) >= c.nbytes()
    # the key names the condition, what encoded it and the bytes: the same encoding, one key
    assert encode_cond("cond-α", _cond(dtype))[0] == key
    assert encode_cond("cond-β", c)[0] != key
    assert encode_cond("cond-α", Cond(c.tensors, c.uncond, "other-model"))[0] != key
    other = Cond({**c.tensors, "condition": c.tensors["condition"] + 1}, c.uncond, c.encoder)
    assert encode_cond("cond-α", other)[0] != key


def test_condition_record_refuses_damage_and_foreign_shapes():
    key, fields = encode_cond("c0", _cond())
    flipped = bytearray(fields["blob"])
    flipped[-3] ^= 0x40                                      # a data byte: the digest catches it
    for spoil, match in [({"blob": bytes(flipped)}, "do not match its key"),
                         ({"key": "f" * 32}, "do not match its key"),
                         ({"format": "2"}, "older vgrpo"), ({"format": "9"}, "'format' is '9'"),
                         ({"blob": b"junk"}, "do not match|safetensors")]:
        with pytest.raises(CorruptEntry, match=match):
            decode_cond({**fields, **spoil})
    with pytest.raises(CorruptEntry, match="missing fields"):
        decode_cond({k: v for k, v in fields.items() if k != "encoder"})
    with pytest.raises(ValueError, match="one row"):
        encode_cond("c0", Cond({"text": torch.zeros(2, 3)}))
    with pytest.raises(ValueError, match="one row"):
        encode_cond("c0", Cond({"text": torch.zeros(1, 3)}, {"text": torch.zeros(3)}))
    with pytest.raises(ValueError, match="cannot be stored"):
        encode_cond("c0", Cond({"text": torch.zeros(1, 3)}, {"image": torch.zeros(1, 3)}))  # uncond ⊄ tensors
    with pytest.raises(ValueError, match="cond_key"):
        encode(uuid.uuid4().hex, make_group().members[0], HEADS, torch.zeros(3), 0.0, cond_key="")


def test_bank_helper_conditions_are_storable():
    assert encode_cond("c0", make_cond("c0"))[0] == encode_cond("c0", make_cond("c0"))[0]


def test_pickle_and_garbage_blobs_rejected():
    import pickle

    _, _, _, meta, _ = _encoded()
    for blob in (pickle.dumps({"x": torch.zeros(3)}), b"", b"\x00" * 8, None):
        with pytest.raises(CorruptEntry):
            decode(meta, blob)


# ---- fuzz ---------------------------------------------------------------------------------
# Valid input must round-trip exactly; anything else must raise CorruptEntry and nothing else.
# Validity is judged independently: the blob by the safetensors library plus the entry's
# shape rules restated here, the metadata by the format's rules restated here.

_FUZZ = settings(max_examples=200, deadline=None, derandomize=True,
                 suppress_health_check=[HealthCheck.too_slow])
_VALID = _encoded()
_FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor: equal bits, NaN payloads included."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _decode_outcome(meta, blob):
    """decode's result, or None for CorruptEntry; any other exception fails the test."""
    try:
        return decode(meta, blob)
    except CorruptEntry:
        return None


_finite = st.floats(allow_nan=False, allow_infinity=False)
_ARG_VALUES = {"eta": _finite, "clamp_c": _finite, "sigma1": st.one_of(st.none(), _finite),
               "sigma_max": st.one_of(st.none(), _finite), "sigma_min": _finite,
               "first_step": st.sampled_from(["sigma1", "clamp"]),
               "log_prob_form": st.sampled_from(["mse", "gaussian"])}


@st.composite
def _trajectories(draw):
    finite = st.floats(allow_nan=False, allow_infinity=False)
    sigmas = draw(st.lists(finite, min_size=2, max_size=6))
    steps = sorted(draw(st.sets(st.integers(0, len(sigmas) - 2), min_size=1, max_size=3)))  # trained steps
    k = len(steps)
    shape = tuple(draw(st.lists(st.integers(0, 3), min_size=4, max_size=4)))   # [C, F, H, W]
    dtype = draw(st.sampled_from(_FLOATS))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    x = torch.randn(k, *shape, generator=gen).to(dtype)
    if x.numel() and draw(st.booleans()):      # a non-finite latent is refused (test below)
        x.reshape(-1)[0] = draw(st.sampled_from([float("nan"), float("inf"), -0.0]))
    heads = draw(st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=4))
    cond = Condition(id=draw(st.text(max_size=20)), prompt=draw(st.text(max_size=60)))
    cls = SCHEME_CLASSES[draw(st.sampled_from(sorted(SCHEMES)))]
    args = {a: draw(_ARG_VALUES[a]) for a in cls.arg_names}
    traj = Trajectory(
        condition=cond, group_id=draw(st.text(max_size=20)), member=draw(st.integers(0, 2**40)),
        seed=draw(st.integers(-2**63, 2**64)), spec=SchemeSpec(cls.name, cls(**args).arguments(), sigmas),
        guidance_scale=draw(finite), policy_version=draw(st.integers(-5, 2**40)),
        step_indices=steps, x=x, x_next=torch.randn(k, *shape, generator=gen).to(dtype),
        logp_old=torch.randn(k, generator=gen).to(draw(st.sampled_from(_FLOATS))),
        final_latents=torch.randn(*shape, generator=gen).to(dtype), frames=None,
        trained_times=draw(st.integers(0, 1000)))
    scores = torch.tensor(draw(st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False),
                                        min_size=len(heads), max_size=len(heads))), dtype=torch.float32)
    return traj, heads, scores, draw(finite)


@_FUZZ
@given(_trajectories())
def test_fuzz_valid_entries_round_trip_exactly(case):
    t, heads, scores, composite = case
    eid = uuid.uuid4().hex
    if not bool(torch.isfinite(t.x).all()):
        with pytest.raises(ValueError, match="'x' has non-finite values"):
            encode(eid, t, heads, scores, composite, status="banked", cond_key=CK)
        return
    meta, parts = encode(eid, t, heads, scores, composite, status="banked", cond_key=CK)
    blob = bytes(parts)
    for stored in (blob, parts):           # as Redis returns it, and unjoined (encode's own check)
        e = decode({k.encode(): v.encode("utf-8") for k, v in meta.items()}, stored)
        assert e.id == eid
    e = decode({k.encode(): v.encode("utf-8") for k, v in meta.items()}, blob)
    r = e.trajectory
    assert (e.id, r.bank_id, e.status, e.heads, e.composite) == (eid, eid, "banked", heads, composite)
    assert _same(e.scores, scores)
    for name in ("x", "x_next", "logp_old", "final_latents"):
        assert _same(getattr(r, name), getattr(t, name)), name
    assert (r.condition.id, r.condition.prompt, e.cond_key) == (t.condition.id, t.condition.prompt, CK)
    for f in ("group_id", "member", "seed", "spec", "guidance_scale", "policy_version",
              "step_indices", "trained_times"):
        assert getattr(r, f) == getattr(t, f), f
    for (_, a), (_, b) in zip(r.spec.params, t.spec.params, strict=True):  # -0.0 stays -0.0
        assert type(a) is type(b) and (not isinstance(a, float) or math.copysign(1, a) == math.copysign(1, b))


def test_encode_refuses_what_decode_would_refuse():
    grp = make_group()
    cases = {
        "logp_old": lambda t: setattr(t, "logp_old", torch.tensor([0.0, float("nan"), 0.0])),
        "step_indices": lambda t: setattr(t, "step_indices", [0, 1, 8]),
        "increasing": lambda t: setattr(t, "step_indices", [2, 1, 0]),
        "member": lambda t: setattr(t, "member", -1),
        "sigmas": lambda t: setattr(t, "spec", dataclasses.replace(t.spec, sigmas=[1.0, float("nan"), 0.0])),
        "scheme_params": lambda t: setattr(t, "spec", dataclasses.replace(t.spec, params=(("eta", 0.5),))),
        "dtype": lambda t: setattr(t, "x", t.x.to(torch.int32)),
        "Unicode": lambda t: setattr(t.condition, "prompt", "bad \ud800 text"),
    }
    for what, spoil in cases.items():
        t = make_group().members[0]
        spoil(t)
        with pytest.raises(ValueError, match=what):
            encode(uuid.uuid4().hex, t, HEADS, grp.scores.values[0], 1.0, cond_key=CK)


def _reference_tensors(blob: bytes, k: int):
    """The blob's tensors as the safetensors library reads them, when they form a valid entry
    of k trained steps (the rules of codec.decode, restated, with the integrity rules: the
    XXH3-64 of the tensor table and the data in `__metadata__`, every float finite); else None."""
    try:
        t = safetensors.torch.load(blob)
    except Exception:  # noqa: BLE001 — the library refuses it: not a valid blob
        return None
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + n])
    digest = (header.pop("__metadata__", None) or {}).get("xxh3_64")
    table = json.dumps({name: header[name] for name in sorted(header)}, separators=(",", ":"))
    if digest != xxhash.xxh3_64_hexdigest(table.encode() + blob[8 + n:]):
        return None
    names = {"x", "x_next", "logp_old", "final_latents"}
    if not names <= set(t) <= names:
        return None
    x = t["x"]
    ok = (x.dim() == 5 and x.shape[0] == k and t["x_next"].shape == x.shape
          and t["logp_old"].shape == (k,) and t["final_latents"].shape == x.shape[1:]
          and all(t[n].is_floating_point() for n in names)
          and all(bool(torch.isfinite(t[n]).all()) for n in names))
    return t if ok else None


def _check_blob(blob: bytes) -> None:
    meta = _VALID[3]
    ref = _reference_tensors(blob, len(_VALID[1].step_indices))
    got = _decode_outcome(meta, blob)
    if ref is None:
        assert got is None, "an invalid blob was accepted"
        return
    assert got is not None, "a valid blob was refused"
    r = got.trajectory
    for name in ("x", "x_next", "logp_old", "final_latents"):
        assert _same(getattr(r, name), ref[name]), name


@_FUZZ
@given(st.binary(max_size=4096))
def test_fuzz_random_blob(blob):
    _check_blob(blob)


@_FUZZ
@given(st.data())
def test_fuzz_mutated_blob(data):
    blob = bytearray(_VALID[4])
    # Flip a few bytes, mostly in the header where the JSON and offsets live.
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.integers(0, min(len(blob) - 1, 600)))
        blob[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.sampled_from([len(blob), len(blob) // 2, 9]))
    _check_blob(bytes(blob[:cut]))


def test_flipped_bits_in_the_data_are_refused():
    """Flipped bits in the tensor data (not the header) are found by the checksum: a bit flip
    is a corrupt entry, never other numbers."""
    for i in (len(_VALID[4]) - 1, len(_VALID[4]) // 2, 700):
        blob = bytearray(_VALID[4])
        blob[i] ^= 1 << (i % 8)
        _check_blob(bytes(blob))
        with pytest.raises(CorruptEntry, match="checksum mismatch"):
            decode(_VALID[3], bytes(blob))


@pytest.mark.parametrize("tensor,value", [("x", float("inf")), ("x_next", float("nan")),
                                          ("final_latents", float("-inf")), ("mu_old", float("inf"))])
def test_non_finite_stored_floats_are_corrupt(tensor, value):
    """A non-finite value in any stored float tensor (with a valid checksum: written by a
    producer that did not check) is a corrupt entry at decode."""
    _, t, _, meta, blob = _encoded()
    tensors = _tensors(blob)
    if tensor == "mu_old":
        tensors["mu_old"] = torch.zeros_like(t.x)
    tensors[tensor].reshape(-1)[3] = value
    with pytest.raises(CorruptEntry, match=f"'{tensor}' has non-finite values"):
        decode(meta, dumps(tensors))


_text_or_bytes = st.one_of(st.text(max_size=40), st.binary(max_size=40),
                           st.sampled_from(["1", "-1", "0", "-0", "01", "1_0", " 1", "1.0",
                                            "0.5", "5e-324", "nan", "inf", "1e999", "[]", "[1, 2]",
                                            '["vq"]', "[0, 1, 2]", "[0.5, 0.25]", "[1e999]", "[true]",
                                            "sage", "fresh", "banked", "true", "{}", "١٢"]))

_INT_FIELDS = ("member", "seed", "version", "trained")
_FLOAT_FIELDS = ("guidance_scale", "composite", "created")
# each scheme's constructor arguments, in order, and the values each may hold (restated)
_FLOAT, _FLOAT_OR_NONE = "float", "float or None"
_ARGS = {"ode": {"eta": _FLOAT}, "dance": {"eta": _FLOAT},
         "flow": {"eta": _FLOAT, "first_step": ("sigma1", "clamp"), "sigma1": _FLOAT_OR_NONE, "clamp_c": _FLOAT},
         "cps": {"eta": _FLOAT, "log_prob_form": ("mse", "gaussian")}, "sage": {"eta": _FLOAT, "clamp_c": _FLOAT},
         "flash": {"eta": _FLOAT, "sigma_max": _FLOAT_OR_NONE, "sigma_min": _FLOAT}}


def _reference_params(scheme: str, text: str):
    """The arguments when `text` is exactly what encode writes for a `scheme`, else None."""
    try:
        p = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(p, dict) or list(p) != list(_ARGS[scheme]) or json.dumps(p) != text:
        return None
    for name, rule in _ARGS[scheme].items():
        v = p[name]
        is_float = isinstance(v, float) and math.isfinite(v)
        ok = is_float if rule == _FLOAT else (is_float or v is None) if rule == _FLOAT_OR_NONE else v in rule
        if not ok:
            return None
    return p


def _json_list(v: str, kind):
    try:
        out = json.loads(v)
    except ValueError:
        return None
    if not isinstance(out, list) or any(isinstance(e, bool) for e in out):
        return None
    if kind is float:
        if not all(isinstance(e, (int, float)) for e in out):
            return None
        try:
            out = [float(e) for e in out]
        except OverflowError:
            return None
        return out if all(math.isfinite(e) for e in out) else None
    return out if all(isinstance(e, kind) for e in out) else None


def _reference_meta(meta: dict):
    """The parsed fields when `meta` (with the valid blob, K=3) is a valid entry, else None."""
    m = {}
    for key, v in meta.items():
        try:
            key = key.decode("utf-8") if isinstance(key, bytes) else key
            m[key] = v.decode("utf-8") if isinstance(v, bytes) else v
        except UnicodeDecodeError:
            return None
    if any(f not in m for f in REQUIRED) or m["format"] != "3" or m["scheme"] not in SCHEMES:
        return None
    if not re.fullmatch(r"[0-9a-f]{32}", m["id"]) or m["status"] not in ("fresh", "banked"):
        return None
    if not re.fullmatch(r"[0-9a-f]{32}", m["cond_key"]):
        return None
    out = {}
    for f in _INT_FIELDS:
        if len(m[f]) > 40 or not re.fullmatch(r"-?[0-9]+", m[f]) or m[f] != str(int(m[f])):
            return None
        out[f] = int(m[f])
    for f in _FLOAT_FIELDS:
        try:
            v = float(m[f])
        except ValueError:
            return None
        if not math.isfinite(v) or repr(v) != m[f]:
            return None
        out[f] = v
    out["scheme"], out["params"] = m["scheme"], _reference_params(m["scheme"], m["scheme_params"])
    out["sigmas"], out["step_indices"] = _json_list(m["sigmas"], float), _json_list(m["step_indices"], int)
    out["heads"], out["scores"] = _json_list(m["heads"], str), _json_list(m["scores"], float)
    if any(out[f] is None for f in ("params", "sigmas", "step_indices", "heads", "scores")):
        return None
    if out["member"] < 0 or out["trained"] < 0 or len(out["sigmas"]) < 2 or not out["heads"]:
        return None
    if len(out["step_indices"]) != 3 or any(not 0 <= s < len(out["sigmas"]) - 1 for s in out["step_indices"]):
        return None
    if out["step_indices"] != sorted(set(out["step_indices"])):   # strictly increasing
        return None
    if len(out["scores"]) != len(out["heads"]):
        return None
    return out


def _check_meta(meta: dict) -> None:
    ref = _reference_meta(meta)
    got = _decode_outcome(meta, _VALID[4])
    if ref is None:
        assert got is None, "invalid metadata was accepted"
        return
    assert got is not None, "valid metadata was refused"
    r = got.trajectory
    assert (r.member, r.seed, r.policy_version, r.trained_times) == tuple(ref[f] for f in _INT_FIELDS)
    assert (r.guidance_scale, got.composite, got.created) == tuple(ref[f] for f in _FLOAT_FIELDS)
    assert (r.spec.name, r.spec.kwargs) == (ref["scheme"], ref["params"])
    assert (list(r.spec.sigmas), r.step_indices, got.heads) == (ref["sigmas"], ref["step_indices"], ref["heads"])
    assert got.scores.tolist() == torch.tensor(ref["scores"], dtype=torch.float32).tolist()


@_FUZZ
@given(st.dictionaries(st.sampled_from(REQUIRED + ("junk",)), _text_or_bytes, max_size=25),
       st.booleans())
def test_fuzz_random_metadata(overrides, drop):
    meta = dict(_VALID[3])
    meta.update(overrides)
    if drop and overrides:
        meta.pop(next(iter(overrides)))
    _check_meta(meta)


@_FUZZ
@given(st.dictionaries(st.one_of(st.text(max_size=10), st.binary(max_size=10)),
                       _text_or_bytes, max_size=30), st.binary(max_size=256))
def test_fuzz_random_everything(meta, blob):
    with pytest.raises(CorruptEntry):     # never all 19 fields, never a valid blob
        decode(meta, blob)


def test_blob_format_is_safetensors_both_ways():
    from memory_bank.tensorfile import dumps, loads, pack

    t = {"a": torch.randn(2, 3), "b": torch.randn(4).to(torch.bfloat16),
         "c": torch.arange(6, dtype=torch.uint8).reshape(2, 3), "d": torch.zeros(0, 5)}
    ours = dumps(t)
    for name, v in safetensors.torch.load(ours).items():     # the library reads ours
        assert torch.equal(v, t[name]) and v.dtype == t[name].dtype
    theirs = safetensors.torch.save(t)
    for name, v in loads(theirs, verify=False).items():     # we read the library's
        assert torch.equal(v, t[name]) and v.dtype == t[name].dtype
    with pytest.raises(ValueError, match="no xxh3_64 checksum"):
        loads(theirs)                                         # but never trust it unchecked
    got = loads(ours)
    got["a"].add_(1)                                          # writable, own memory
    assert torch.equal(got["a"], t["a"] + 1)
    parts = pack(t)                                           # unjoined: the same bytes, and
    assert bytes(parts) == ours and len(parts) == len(ours)
    for name, v in loads(parts).items():                      # read from the tensors' own memory
        assert torch.equal(v, t[name]) and (v.numel() == 0 or v.data_ptr() == t[name].data_ptr())


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
    # a read-only view (what memory_bank.wire receives a large reply into) is viewed
    ro = memoryview(ba).toreadonly()
    assert lo_ba <= loads(ro, copy=False)["a"].data_ptr() < lo_ba + len(ba)


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


def test_finite_check_is_exact_when_the_fast_sum_overflows():
    from memory_bank.tensorfile import finite

    assert finite(torch.tensor([3e38, 3e38, 1.0]))            # the sum overflows; every value is finite
    assert finite(torch.full((1000,), 60000.0).half())
    assert finite(torch.tensor([1e308, 1e308], dtype=torch.float64))
    for bad in (float("nan"), float("inf"), float("-inf")):
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            t = torch.zeros(64, dtype=dtype)
            t[17] = bad
            assert not finite(t), (bad, dtype)
    assert finite(torch.arange(5)) and finite(torch.zeros(0))  # integers and empty tensors
