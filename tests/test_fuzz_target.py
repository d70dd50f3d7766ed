"""The atheris target keeps working: its seeds are valid messages, and mangled ones are only refused."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path
from types import ModuleType

import pytest

from srl.runner.distribution.wire.codec import DecodeError


def load_target() -> ModuleType:
    path = Path(__file__).resolve().parents[1] / "fuzz" / "fuzz_codec.py"
    spec = importlib.util.spec_from_file_location("fuzz_codec", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["fuzz_codec"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def target() -> ModuleType:
    return load_target()


def test_the_seeds_are_what_a_node_accepts(target: ModuleType) -> None:
    batch, compressed, params, config = target.seeds()
    meta, columns, _ = target.UNSIGNED.decode_batch(batch, target.SCHEMA)
    assert set(columns) == set(target.SCHEMA.columns) and meta.count == 4
    target.UNSIGNED.decode_batch(compressed, target.SCHEMA)
    target.UNSIGNED.decode_params(params, epoch=1, version=2)
    with pytest.raises(DecodeError, match="unsigned message refused"):
        target.SIGNED.decode_batch(batch, target.SCHEMA)
    assert config.startswith(b"{")


def test_mangled_seeds_only_ever_give_the_decoders_own_errors(target: ModuleType) -> None:
    rng = random.Random(0)
    for seed in target.seeds():
        target.one_input(seed)
        for _ in range(300):
            data = bytearray(seed)
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            target.one_input(bytes(data[: rng.randint(0, len(data))]))  # anything else raises here
