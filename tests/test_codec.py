"""The wire codec: round trips, and that nothing but DecodeError ever comes out of bad bytes."""

from __future__ import annotations

import pickle
import random
import struct
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

from srl.base.arrays import pack_arrays
from srl.runner.distribution.codec import (
    FLAG_COMPRESSED,
    MAGIC,
    WIRE_VERSION,
    BatchHeader,
    Codec,
    DecodeError,
    row_nbytes,
    split_columns,
)


def make_batch(n: int = 256, seed: int = 0) -> tuple[BatchHeader, dict[str, np.ndarray], np.ndarray]:
    rng = np.random.default_rng(seed)
    columns: dict[str, np.ndarray] = {
        "obs": rng.random((n, 3), dtype=np.float32),
        "next_obs": rng.random((n, 3), dtype=np.float32),
        "action": rng.integers(0, 5, n).astype(np.int64),
        "reward": rng.random(n, dtype=np.float32),
        "discount": np.full(n, 0.99, np.float32),
    }
    header = BatchHeader("actor-1f2e", 3, 2, 41, 17, n, time.time())
    return header, columns, rng.random(n).astype(np.float32)


def assert_same_batch(a: tuple, b: tuple) -> None:
    assert a[0] == b[0]
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        np.testing.assert_array_equal(a[1][name], b[1][name])
        assert a[1][name].dtype == b[1][name].dtype
    if a[2] is None:
        assert b[2] is None
    else:
        np.testing.assert_array_equal(a[2], b[2])


@pytest.mark.parametrize("secret", [b"", b"s3cret", "text secret"])
@pytest.mark.parametrize("compress", [False, True])
def test_batch_round_trip(secret: bytes | str, compress: bool) -> None:
    codec = Codec(secret=secret, compress=compress)
    batch = make_batch()
    data = codec.encode_batch(*batch)
    assert data[:4] == MAGIC and data[4] == WIRE_VERSION
    assert_same_batch(batch, codec.decode_batch(data))
    assert_same_batch(batch, codec.decode_batch(memoryview(data), copy=False))


def test_batch_without_priorities_and_empty_batch() -> None:
    codec = Codec(secret="")
    header, columns, _ = make_batch(5)
    assert_same_batch((header, columns, None), codec.decode_batch(codec.encode_batch(header, columns, None)))
    empty = BatchHeader("a", 0, 0, 0, 0, 0, 0.0)
    cols = {"obs": np.zeros((0, 3), np.float32)}
    assert_same_batch((empty, cols, None), codec.decode_batch(codec.encode_batch(empty, cols, None)))


def test_encode_refuses_inconsistent_batch() -> None:
    codec = Codec(secret="")
    header, columns, priorities = make_batch(8)
    columns["reward"] = columns["reward"][:7]
    with pytest.raises(ValueError, match="reward"):
        codec.encode_batch(header, columns, priorities)
    header, columns, _ = make_batch(8)
    with pytest.raises(ValueError, match="priorities"):
        codec.encode_batch(header, columns, np.full(8, np.nan, np.float32))
    with pytest.raises(ValueError, match="max_bytes"):
        Codec(secret="", max_bytes=4096).encode_batch(*make_batch(1000))


def test_params_round_trip_compressed_signed() -> None:
    codec = Codec(secret="k", compress=True)
    arrays: dict[str, np.ndarray] = {
        "q.weight": np.arange(12, dtype=np.float32).reshape(3, 4),
        "q.bias": np.ones(3, np.float64),
    }
    meta = {"epoch": 2, "version": 9, "train_count": 1234, "algorithm": "dqn"}
    got_meta, got = codec.decode_params(codec.encode_params(arrays, meta))
    assert got_meta == meta
    for name, array in arrays.items():
        np.testing.assert_array_equal(got[name], array)
    with pytest.raises(DecodeError, match="expected a BATCH message"):
        codec.decode_batch(codec.encode_params(arrays, meta))


def test_secret_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SRL_SECRET", "from-env")
    assert Codec().signed
    data = Codec().encode_batch(*make_batch(4))
    Codec(secret="from-env").decode_batch(data)
    monkeypatch.setenv("SRL_SECRET", "")
    assert not Codec().signed


def test_tampered_byte_is_refused() -> None:
    codec = Codec(secret="k")
    data = bytearray(codec.encode_batch(*make_batch(16)))
    for position in (4 + 3, len(data) // 2, len(data) - 1):
        tampered = bytearray(data)
        tampered[position] ^= 0x01
        with pytest.raises(DecodeError, match="signature"):
            codec.decode_batch(bytes(tampered))


def test_unsigned_refused_when_secret_set_and_signed_refused_without_secret() -> None:
    unsigned = Codec(secret="").encode_batch(*make_batch(4))
    with pytest.raises(DecodeError, match="unsigned"):
        Codec(secret="k").decode_batch(unsigned)
    signed = Codec(secret="k").encode_batch(*make_batch(4))
    with pytest.raises(DecodeError, match="SRL_SECRET"):
        Codec(secret="").decode_batch(signed)
    with pytest.raises(DecodeError, match="signature"):
        Codec(secret="other").decode_batch(signed)


def test_wrong_wire_version_names_both_versions() -> None:
    data = bytearray(Codec(secret="").encode_batch(*make_batch(4)))
    data[4] = WIRE_VERSION + 1
    with pytest.raises(DecodeError) as info:
        Codec(secret="").decode_batch(bytes(data))
    text = str(info.value)
    assert f"wire version {WIRE_VERSION + 1}" in text
    assert f"reads wire version {WIRE_VERSION}" in text
    assert "same srl version" in text


@pytest.mark.parametrize("secret", ["", "k"])
@pytest.mark.parametrize("compress", [False, True])
def test_every_truncation_is_a_decode_error(secret: str, compress: bool) -> None:
    codec = Codec(secret=secret, compress=compress)
    data = codec.encode_batch(*make_batch(8))
    for length in range(len(data)):
        with pytest.raises(DecodeError):
            codec.decode_batch(data[:length])


def test_too_large_and_decompression_bomb() -> None:
    codec = Codec(secret="", max_bytes=64 * 1024)
    with pytest.raises(DecodeError, match="max_bytes"):
        codec.decode_batch(b"\0" * (64 * 1024 + 1))
    # ~8 KiB on the wire that inflates to 8 MiB: must stop at max_bytes, not allocate it all.
    bomb = zlib.compress(b"\0" * (8 * 2**20), 9)
    assert len(bomb) < 16 * 1024
    frame = struct.pack("<4sBBB", MAGIC, WIRE_VERSION, 1, FLAG_COMPRESSED) + bomb
    big = Codec(secret="", max_bytes=len(frame) + 1024)
    with pytest.raises(DecodeError, match="expands past max_bytes"):
        big.decode_batch(frame)


def test_pickle_payload_is_refused_and_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self) -> tuple:
            return (open, (str(marker), "w"))

    codec = Codec(secret="")
    payload = pickle.dumps(Exploit())
    for data in (payload, struct.pack("<4sBBB", MAGIC, WIRE_VERSION, 1, 0) + payload):
        with pytest.raises(DecodeError):
            codec.decode_batch(data)
        with pytest.raises(DecodeError):
            codec.decode_params(data)
    assert not marker.exists()


def test_bad_array_headers_are_decode_errors() -> None:
    codec = Codec(secret="")
    frame = struct.pack("<4sBBB", MAGIC, WIRE_VERSION, 1, 0)
    header, columns, _ = make_batch(4)
    meta = {k: getattr(header, k) for k in header.__dataclass_fields__}
    cases = [
        pack_arrays({"c:obs": columns["obs"]}, {**meta, "count": 5}),  # count mismatch
        pack_arrays({"c:obs": columns["obs"], "p": np.ones(3, np.float32)}, meta),  # priorities length
        pack_arrays({"c:obs": columns["obs"], "p": np.ones(4, np.int32)}, meta),  # priorities dtype
        pack_arrays({"c:obs": columns["obs"], "p": np.full(4, np.inf, np.float32)}, meta),
        pack_arrays({"c:obs": columns["obs"], "other": columns["obs"]}, meta),  # unknown array
        pack_arrays({"c:obs": columns["obs"]}, {**meta, "seq": "41"}),  # wrong type
        pack_arrays({"c:obs": columns["obs"]}, {**meta, "epoch": True}),
        pack_arrays({"c:obs": columns["obs"]}, {**meta, "actor_index": -1}),
        pack_arrays({"c:obs": columns["obs"]}, {**meta, "created_at": float("nan")}),
        pack_arrays({"c:obs": columns["obs"]}, {**meta, "actor_id": ""}),
        pack_arrays({"c:obs": columns["obs"]}, {k: v for k, v in meta.items() if k != "actor_id"}),
        pack_arrays({"c:s": np.float32(1.0).reshape(())}, meta),  # a 0-d column
        b"SRLA\x01\xff\xff\xff\x7f{",  # header length past the end
        b"SRLA\x01\x05\x00\x00\x00" + b"[" * 5,
        b"SRLA\x01\x00\x10\x00\x00" + b"[" * 4096,  # deep nesting
    ]
    for payload in cases:
        with pytest.raises(DecodeError):
            codec.decode_batch(frame + payload)


def test_garbage_never_raises_anything_but_decode_error() -> None:
    rng = random.Random(1234)
    for secret in ("", "k"):
        for compress in (False, True):
            codec = Codec(secret=secret, compress=compress, max_bytes=1 << 20)
            valid = codec.encode_batch(*make_batch(6))
            params = codec.encode_params({"w": np.ones((2, 2), np.float32)}, {"version": 1})
            for _ in range(1500):
                base = bytearray(rng.choice([valid, params]))
                how = rng.randrange(5)
                if how == 0:
                    data = bytes(rng.getrandbits(8) for _ in range(rng.randrange(64)))
                elif how == 1:
                    data = bytes(base[:7]) + bytes(rng.getrandbits(8) for _ in range(rng.randrange(200)))
                else:
                    for _ in range(rng.randint(1, 4)):
                        position = rng.randrange(len(base))
                        base[position] = rng.getrandbits(8) if how != 3 else base[position] ^ (1 << rng.randrange(8))
                    data = bytes(base[: rng.randrange(len(base) + 1)]) if how == 4 else bytes(base)
                for decode in (codec.decode_batch, codec.decode_params):
                    try:
                        decode(data)
                    except DecodeError:
                        pass


def test_unsigned_mutations_reach_the_parser_and_stay_decode_errors() -> None:
    """Without a signature every mutated byte reaches the JSON/array parser: still only DecodeError."""
    rng = random.Random(99)
    codec = Codec(secret="")
    valid = codec.encode_batch(*make_batch(3))
    for position in range(7, len(valid)):
        for value in (0, 0xFF, rng.getrandbits(8), ord("9"), ord('"'), ord("-")):
            data = bytearray(valid)
            data[position] = value
            try:
                codec.decode_batch(bytes(data))
            except DecodeError:
                pass


def test_split_columns_and_row_estimate() -> None:
    _, columns, priorities = make_batch(10)
    chunks = split_columns(columns, priorities, 4)
    assert [len(p) for _, p in chunks if p is not None] == [4, 4, 2]
    np.testing.assert_array_equal(np.concatenate([c["obs"] for c, _ in chunks]), columns["obs"])
    assert row_nbytes(columns, priorities) == 12 + 12 + 8 + 4 + 4 + 4
    codec = Codec(secret="k", compress=True)
    big_header, big_columns, big_priorities = make_batch(5000)
    limit = 32 * 1024
    rows = codec.max_rows(big_columns, big_priorities, limit)
    assert 300 < rows < limit // row_nbytes(big_columns, big_priorities)
    start = 0
    for cols, pri in split_columns(big_columns, big_priorities, rows):
        count = len(cols["obs"])
        part = BatchHeader(big_header.actor_id, 0, 1, start, 1, count, 0.0)
        assert len(codec.encode_batch(part, cols, pri)) <= limit
        start += 1
    with pytest.raises(ValueError, match="max_rows"):
        split_columns(columns, priorities, 0)
