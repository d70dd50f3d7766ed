"""The wire codec: round trips, and that nothing but DecodeError ever comes out of bad bytes."""

from __future__ import annotations

import json
import pickle
import random
import struct
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from srl.base.schema import Column, Schema
from srl.runner.distribution.wire.codec import (
    ERROR_TEXT_LIMIT,
    FLAG_COMPRESSED,
    KIND_PARAMS,
    MAGIC,
    WIRE_VERSION,
    BatchHeader,
    Codec,
    DecodeError,
    batch_message_bytes,
    join_frames,
    row_nbytes,
    split_columns,
)
from tests.forge import CODES, HEAD, forge_batch, frame, layout, padded, raw_container

SCHEMA = Schema(
    {
        "obs": Column("float32", (3,)),
        "next_obs": Column("float32", (3,)),
        "action": Column("int64", (), low=0, high=4),
        "reward": Column("float32"),
        "discount": Column("float32", (), low=0.0, high=1.0),
    },
    priorities=True,
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
    assert_same_batch(batch, codec.decode_batch(memoryview(data)))
    assert_same_batch(batch, codec.decode_batch(data, SCHEMA))


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


def test_the_batch_layout_is_the_documented_one() -> None:
    """The encoder writes, byte for byte, what a writer following the codec's docstring writes."""
    header, columns, priorities = make_batch(5)
    for pri in (priorities, None):
        written = Codec(secret="").encode_batch(header, columns, pri)
        assert written == forge_batch(columns, pri, actor=header.actor_id.encode(), actor_index=3, epoch=2, seq=41,
                                      params_version=17, created_at=header.created_at)


def test_layouts_are_told_apart_and_byte_order_is_little_endian() -> None:
    codec = Codec(secret="")
    header, columns, _ = make_batch(6)
    wide = {**columns, "obs": columns["obs"].astype(np.float64)}
    swapped = {**columns, "reward": columns["reward"].astype(">f4")}
    for _ in range(2):  # the second pass reads remembered layouts
        for cols in (columns, wide, swapped):
            _, got, _ = codec.decode_batch(codec.encode_batch(header, cols, None))
            assert {k: v.dtype.str for k, v in got.items()} == {
                k: v.dtype.newbyteorder("<").str for k, v in cols.items()}
            for name in cols:
                np.testing.assert_array_equal(got[name], cols[name])


@pytest.mark.parametrize("compress", [False, True])
def test_frames_of_one_layout_join_into_the_rows_each_decodes_to(compress: bool) -> None:
    codec = Codec(secret="k", compress=compress)
    batches = [make_batch(n, seed=n) for n in (3, 1, 0, 5)]
    frames = [codec.open_batch(codec.encode_batch(*batch)) for batch in batches]
    columns, priorities = join_frames(frames)
    decoded = [codec.decode_batch(codec.encode_batch(*batch), SCHEMA) for batch in batches]
    assert_same_batch((None, columns, priorities),
                      (None, {name: np.concatenate([d[1][name] for d in decoded]) for name in columns},
                       np.concatenate([d[2] for d in decoded])))
    assert SCHEMA.problem(columns, priorities) is None
    # aligned, so numpy's reductions run at full speed: a view into a message starts 7 bytes in
    assert all(a.flags.aligned for a in (*columns.values(), priorities, *frames[0].arrays()[0].values()))
    with pytest.raises(ValueError, match="at least one frame"):
        join_frames([])
    header, cols, _ = batches[0]
    unprioritized = codec.open_batch(codec.encode_batch(header, cols, None))
    renamed = codec.open_batch(codec.encode_batch(header, {**cols, "extra": cols["reward"]}, batches[0][2]))
    for other in (unprioritized, renamed):  # a layout of its own: never read as if it were the first's
        assert other.layout != frames[0].layout
        with pytest.raises(ValueError, match="different columns"):
            join_frames([frames[0], other])


def test_a_mutable_message_is_copied_before_its_arrays_are_made() -> None:
    codec = Codec(secret="k")
    batch = make_batch(4)
    data = bytearray(codec.encode_batch(*batch))
    frame = codec.open_batch(data)
    data[:] = bytes(len(data))  # the sender's buffer changes after the signature was checked
    assert_same_batch(batch, (frame.header, *frame.arrays()))


def test_remembered_layouts_stay_few_and_small_whatever_is_sent() -> None:
    from srl.runner.distribution.wire import batch as batch_module

    codec = Codec(secret="")
    header, columns, _ = make_batch(2)
    for i in range(200):  # 200 layouts: column names no task has
        codec.decode_batch(codec.encode_batch(header, {f"c{i}": columns["obs"]}, None))
        assert len(batch_module._entries) <= 64
    wide = {f"{i:0>250}": columns["reward"] for i in range(20)}  # a 5 KB layout is parsed, not kept
    _, got, _ = codec.decode_batch(codec.encode_batch(header, wide, None))
    assert got.keys() == wide.keys()
    assert all(len(key) <= 4096 + 1 for key in batch_module._entries)


def test_encode_refuses_what_decode_would_with_a_clear_error() -> None:
    codec = Codec(secret="")
    header, columns, _ = make_batch(2)
    with pytest.raises(ValueError, match="actor_id"):
        codec.encode_batch(BatchHeader("\ud800", 0, 0, 0, 0, 2, 1.0), columns, None)  # a lone surrogate
    with pytest.raises(ValueError, match="UTF-8"):
        codec.encode_batch(header, {"\ud800": columns["obs"]}, None)
    many = {f"{i:03d}" + "x" * 250: np.zeros((2,) + (1,) * 32, np.float32) for i in range(300)}
    with pytest.raises(ValueError, match="at most 65535"):
        codec.encode_batch(header, many, None)


def test_batch_message_bytes_bounds_what_an_actor_sends() -> None:
    """The trainer's size bound for a schema holds for incompressible rows, compressed and signed, the
    longest actor id and long names (an honest actor must never be refused for size)."""
    rng = np.random.default_rng(0)
    schemas = [
        SCHEMA,
        Schema({"obs": Column("uint8", (4, 84, 84)), "version": Column("int64")}),
        Schema({"é" * 127: Column("bool", (3,)), "b": Column("float16", (1,) * 32)}, priorities=True),
    ]
    for schema in schemas:
        for rows in (1, 7, 300):
            cols = {n: (rng.random((rows, *c.shape)) * 255).astype(c.dtype) for n, c in schema.columns.items()}
            pri = rng.random(rows).astype(np.float32) if schema.priorities else None
            header = BatchHeader("é" * 128, 1, 2, 3, 4, rows, time.time())
            for compress in (False, True):
                data = Codec(secret="k", compress=compress, task="t", max_bytes=1 << 30).encode_batch(header, cols, pri)
                assert len(data) <= batch_message_bytes(schema, rows)


def test_forged_batch_heads_and_layouts_are_decode_errors() -> None:
    """Every field of a batch may lie; each lie is a DecodeError, and nothing is allocated for a claimed size."""
    codec = Codec(secret="")
    _, columns, priorities = make_batch(4)
    obs = {"obs": columns["obs"]}
    truth = forge_batch(columns, priorities)
    assert_same_batch((codec.decode_batch(truth)[0], columns, priorities), codec.decode_batch(truth, SCHEMA))
    one = layout(obs)
    cases = {
        "rows": forge_batch(obs, count=5),
        "rows, none sent": forge_batch(obs, count=2**32 - 1),
        "priorities of another length": forge_batch(obs, np.ones(6, np.float32)),
        "integer priorities": forge_batch(obs, np.ones(4, np.int32)),
        "priorities claimed, none sent": forge_batch(obs, priorities_code=CODES["float32"]),
        "priorities sent, none claimed": forge_batch(obs, np.ones(4, np.float32), priorities_code=0),
        "an unknown priorities dtype": forge_batch(obs, np.ones(4, np.float32), priorities_code=200),
        "a negative actor index": forge_batch(obs, actor_index=-1),
        "a negative seq": forge_batch(obs, seq=-(2**63)),
        "created_at NaN": forge_batch(obs, created_at=float("nan")),
        "created_at infinite": forge_batch(obs, created_at=float("inf")),
        "created_at negative": forge_batch(obs, created_at=-1.0),
        "created_at in the year 10**292": forge_batch(obs, created_at=1e300),
        "no actor id": forge_batch(obs, actor=b""),
        "an actor id of 300 bytes": forge_batch(obs, actor=b"x" * 300),
        "an actor id that is not UTF-8": forge_batch(obs, actor=b"\xff\xfe"),
        "no columns": forge_batch(obs, layout_bytes=struct.pack("<H", 0)),
        "a column twice": forge_batch(obs, layout_bytes=struct.pack("<H", 2) + one[2:] * 2,
                                      body=padded(obs["obs"].tobytes()) * 2),
        "an empty column name": forge_batch({"": obs["obs"]}),
        "a name that is not UTF-8": forge_batch(obs, layout_bytes=one.replace(b"obs", b"\xffbs")),
        "an unknown dtype code": forge_batch(obs, layout_bytes=one[:6] + b"\x0d" + one[7:]),
        "dtype code 0": forge_batch(obs, layout_bytes=one[:6] + b"\x00" + one[7:]),
        "200 dimensions": forge_batch(obs, layout_bytes=one[:7] + bytes([200]) + one[8:]),
        "a layout cut short": forge_batch(obs, layout_bytes=one[:-2]),
        "stray layout bytes": forge_batch(obs, layout_bytes=one + b"\0"),
        "a row of 2**64 bytes": forge_batch(obs, layout_bytes=layout(obs, {"obs": (2**32 - 1, 2**32 - 1)})),
        "a row of 2**64 bytes, one row": forge_batch(obs, count=1,
                                                     layout_bytes=layout(obs, {"obs": (2**32 - 1, 2**32 - 1)})),
        "an empty row whose other dimensions overflow": forge_batch(
            {"obs": np.zeros((1, 0), np.float32)}, layout_bytes=layout(obs, {"obs": (0, 2**32 - 1, 2**32 - 1)})),
        "no rows of 2**64 bytes": forge_batch(
            {"obs": np.zeros((0, 3), np.float32)}, layout_bytes=layout(obs, {"obs": (2**32 - 1, 2**32 - 1)})),
        "a trailing byte": forge_batch(obs) + b"x",
        "a buffer one byte short": forge_batch(obs, body=obs["obs"].tobytes()[:-1]),
        "a head alone": frame(HEAD.pack(8, 0, 4, 0, 0, 0, 0, 0, 1.0, 0)),
        "a head shorter than itself": frame(HEAD.pack(8, 0, 4, 0, 0, 0, 0, 0, 1.0, 0)[:-1]),
        "lengths past the end": frame(HEAD.pack(65535, 65535, 4, 0, 0, 0, 0, 0, 1.0, 0) + b"intruder"),
    }
    for case, data in cases.items():
        with pytest.raises(DecodeError):
            codec.decode_batch(data)
            pytest.fail(f"accepted: {case}")
    with pytest.raises(DecodeError, match="not the expected"):  # a valid batch of other columns
        codec.decode_batch(forge_batch(obs), SCHEMA)


def test_bad_params_containers_are_decode_errors() -> None:
    """A params payload is a safetensors container: offsets, dtypes and its JSON header may all lie."""
    codec = Codec(secret="")
    obs = np.zeros((4, 3), np.float32)
    obs_entry = {"dtype": "F32", "shape": [4, 3], "data_offsets": [0, 48]}
    meta = {"srl": json.dumps({"epoch": 1, "version": 1})}
    cases = [
        raw_container({"__metadata__": {"srl": '{"epoch": NaN'}, "w": obs_entry}, obs.tobytes()),
        raw_container({"__metadata__": meta, "w": obs_entry, "w2": obs_entry}, obs.tobytes()),  # shared bytes
        raw_container({"__metadata__": meta, "w": obs_entry}, obs.tobytes() + b"x"),  # trailing
        raw_container({"__metadata__": meta, "w": {**obs_entry, "data_offsets": [4, 52]}}, b"\0" * 52),  # a gap
        raw_container({"__metadata__": meta, "w": {**obs_entry, "dtype": "BF16"}}, b"\0" * 48),
        raw_container({"__metadata__": meta, "w": {**obs_entry, "shape": [2**40, 2**40]}}, obs.tobytes()),
        raw_container({"__metadata__": meta}, b"", pad_to=70 * 1024),  # a header over 64 KiB
        raw_container({"__metadata__": {"srl": "[" * 5000}}, b""),  # deep nesting in the meta
        struct.pack("<Q", 2**63) + b"{}",  # header length past the end
        struct.pack("<Q", 5) + b"[" * 5,
    ]
    for payload in cases:
        with pytest.raises(DecodeError):
            codec.decode_params(frame(payload, kind=KIND_PARAMS))


def test_a_huge_json_header_is_refused_before_parsing() -> None:
    """14.7 KB of compressed header used to make the trainer allocate 401 MiB before refusing it."""
    header = {"__metadata__": {"srl": json.dumps({"pad": "x" * (40 * 2**20)})}}
    data = frame(raw_container(header, b""), compressed=True, kind=KIND_PARAMS)
    assert len(data) < 64 * 1024
    with pytest.raises(DecodeError, match=r"expands past max_bytes|over the 65536-byte limit"):
        Codec(secret="", max_bytes=1 << 20).decode_params(data)
    with pytest.raises(DecodeError, match="65536-byte limit"):
        Codec(secret="", max_bytes=64 << 20).decode_params(data)


def test_decode_error_text_is_short() -> None:
    """A 16 KB malformed message once produced a 16 MiB error text (then logged and copied into events)."""
    _, columns, _ = make_batch(4)
    name = "n" * 255
    codec = Codec(secret="")
    cases = [
        lambda: codec.decode_batch(forge_batch(columns, actor=b"a" * 16_000), SCHEMA),
        lambda: codec.decode_batch(forge_batch({name: columns["obs"]}), SCHEMA),
        lambda: codec.decode_batch(forge_batch({name: columns["obs"]}, count=3), SCHEMA),
        lambda: codec.decode_params(frame(raw_container({"x" * 16_000: 1}, b""), kind=KIND_PARAMS)),
    ]
    for decode in cases:
        with pytest.raises(DecodeError) as info:
            decode()
        assert len(str(info.value)) <= ERROR_TEXT_LIMIT


def test_schema_refuses_what_does_not_fit_the_algorithm() -> None:
    codec = Codec(secret="")
    header, columns, priorities = make_batch(8)
    good = codec.decode_batch(codec.encode_batch(header, columns, priorities), SCHEMA)
    assert good[0] == header

    def refused(why: str, cols: dict[str, np.ndarray], pri: np.ndarray | None = priorities) -> None:
        with pytest.raises(DecodeError, match=why):
            codec.decode_batch(codec.encode_batch(header, cols, pri), SCHEMA)

    refused("junk", {"junk": columns["obs"]})  # the forged first batch of old
    refused("missing", {k: v for k, v in columns.items() if k != "discount"})
    refused("dtype float64", {**columns, "reward": columns["reward"].astype(np.float64)})
    refused("shape", {**columns, "obs": np.zeros((8, 4), np.float32)})
    refused("above its upper bound", {**columns, "action": np.full(8, 10**9, np.int64)})
    refused("below its lower bound", {**columns, "action": np.full(8, -1, np.int64)})
    refused("NaN", {**columns, "obs": np.full((8, 3), np.nan, np.float32)})
    refused("upper bound", {**columns, "discount": np.full(8, 2.0, np.float32)})
    # values are the schema's check (the encoder refuses them too, see above): a forged frame gets here
    for bad in (np.inf, np.nan, -1.0):
        with pytest.raises(DecodeError, match="priorities must be finite"):
            codec.decode_batch(forge_batch(columns, np.full(8, bad, np.float32)), SCHEMA)
    no_priorities = Schema(dict(SCHEMA.columns), priorities=False)
    with pytest.raises(DecodeError, match="carry none"):
        codec.decode_batch(codec.encode_batch(header, columns, priorities), no_priorities)


def test_signatures_are_bound_to_the_task() -> None:
    batch = make_batch(4)
    data = Codec(secret="k", task="task-a").encode_batch(*batch)
    assert_same_batch(batch, Codec(secret="k", task="task-a").decode_batch(data))
    with pytest.raises(DecodeError, match="another task"):
        Codec(secret="k", task="task-b").decode_batch(data)


def test_params_meta_must_agree_with_the_board() -> None:
    codec = Codec(secret="k", task="t")
    old = codec.encode_params({"w": np.zeros(2, np.float32)}, {"epoch": 1, "version": 3})
    assert codec.decode_params(old, epoch=1, version=3)[0]["version"] == 3
    # the old signed blob written back under a newer version: refused
    with pytest.raises(DecodeError, match="old blob"):
        codec.decode_params(old, epoch=1, version=9)
    with pytest.raises(DecodeError, match="epoch"):
        codec.decode_params(old, epoch=2, version=3)


def test_config_signature() -> None:
    signed, unsigned = Codec(secret="k", task="t"), Codec(secret="", task="t")
    config = '{"algorithm":"dqn"}'
    signature = signed.config_signature(config)
    signed.check_config_signature(config, signature)
    unsigned.check_config_signature(config, "")
    assert unsigned.config_signature(config) == ""
    with pytest.raises(DecodeError, match="changed on the board"):
        signed.check_config_signature('{"algorithm":"dqn","x":1}', signature)
    with pytest.raises(DecodeError, match="changed on the board"):
        Codec(secret="k", task="other").check_config_signature(config, signature)
    with pytest.raises(DecodeError, match="unsigned task config"):
        signed.check_config_signature(config, "")
    with pytest.raises(DecodeError, match="no secret is set"):
        unsigned.check_config_signature(config, signature)


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


# ---------------------------------------------------------------- property tests (hypothesis, bounded budget)
PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


@PROPERTY
@given(st.binary(max_size=2048), st.sampled_from(["", "k"]))
def test_property_any_bytes_give_only_decode_errors(data: bytes, secret: str) -> None:
    codec = Codec(secret=secret, max_bytes=1 << 20)
    for decode in (lambda d: codec.decode_batch(d, SCHEMA), codec.decode_params):
        try:
            decode(data)
        except DecodeError:
            pass


@PROPERTY
@given(st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=8),
       st.integers(0, 10_000), st.booleans())
def test_property_mutated_messages_give_only_decode_errors(
    edits: list[tuple[int, int]], cut: int, compress: bool
) -> None:
    codec = Codec(secret="", compress=compress, max_bytes=1 << 20)
    data = bytearray(codec.encode_batch(*make_batch(5)))
    for position, value in edits:
        data[position % len(data)] = value
    try:
        header, columns, _ = codec.decode_batch(bytes(data[: max(1, len(data) - cut % 64)]), SCHEMA)
    except DecodeError:
        return
    assert SCHEMA.problem(columns) is None  # whatever passes fits the schema exactly
    assert header.count == len(columns["obs"])


@PROPERTY
@given(st.integers(0, 300), st.integers(0, 2**63 - 1), st.floats(0, 1e11), st.text(min_size=1, max_size=256),
       st.booleans())
def test_property_valid_batches_round_trip(n: int, seq: int, created_at: float, actor_id: str, signed: bool) -> None:
    codec = Codec(secret="k" if signed else "", task="t")
    _, columns, priorities = make_batch(n, seed=n)
    header = BatchHeader(actor_id, 1, 2, seq, 3, n, created_at)
    assert_same_batch((header, columns, priorities), codec.decode_batch(codec.encode_batch(header, columns, priorities),
                                                                        SCHEMA))
