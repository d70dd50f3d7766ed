"""The safetensors container of params and checkpoints: arrays that come back writable, and files that are
replaced whole, durably, leaving nothing behind when the disk is full."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
import pytest

from srl.base import arrays as arrays_module
from srl.base.arrays import load_arrays, pack_arrays, save_arrays, unpack_arrays
from tests.full_disk import run_with_full_disk


def test_unpacked_and_loaded_arrays_are_writable_copies(tmp_path: Path) -> None:
    original = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "step": np.array(7, np.int64)}
    blob = pack_arrays(original, {"version": 1})
    _, unpacked = unpack_arrays(blob)
    save_arrays(tmp_path / "a.safetensors", original, {"version": 1})
    _, loaded = load_arrays(tmp_path / "a.safetensors")
    for got in (unpacked, loaded):
        for name, array in got.items():
            assert array.flags.writeable, f"{name} is read-only"
            assert array.shape == original[name].shape and array.dtype == original[name].dtype
            array += 1  # what a caller that was promised its own copy may do
            np.testing.assert_array_equal(array, original[name] + 1)
    assert unpack_arrays(blob)[1]["w"][0, 0] == 0  # the bytes it came from are untouched


def test_arrays_stay_writable_if_safetensors_hands_over_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    import safetensors

    real = safetensors.deserialize

    def as_its_stub_says(data: bytes) -> list[tuple[str, dict[str, object]]]:  # bytes, not bytearray
        return [(name, {**info, "data": bytes(info["data"])}) for name, info in real(data)]

    monkeypatch.setattr(safetensors, "deserialize", as_its_stub_says)
    _, got = unpack_arrays(pack_arrays({"w": np.arange(4, dtype=np.float32)}))
    assert got["w"].flags.writeable
    got["w"][0] = 5.0
    assert got["w"].tolist() == [5.0, 1.0, 2.0, 3.0]


def test_a_file_that_does_not_fit_leaves_the_old_one_and_no_temporary_file(tmp_path: Path) -> None:
    target = tmp_path / "ckpt.safetensors"
    save_arrays(target, {"w": np.zeros(4, np.float32)}, {"train_count": 1})
    done = run_with_full_disk("""
        try:
            save_arrays(sys.argv[1], {"w": np.ones(65536, np.float32)}, {"train_count": 2})
        except OSError as e:
            print("refused:", e)
    """, str(target), setup="""
        import sys
        import numpy as np
        from srl.base.arrays import save_arrays
    """)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.safetensors"], "a partial file stays beside it"
    assert "refused: [Errno 27] File too large" in done.stdout and str(target) in done.stdout, done.stdout
    meta, kept = load_arrays(target)
    assert meta["train_count"] == 1 and kept["w"].shape == (4,)


def test_the_data_reaches_the_disk_before_the_rename_and_the_rename_after_it(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        calls.append("fsync directory" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        real_fsync(fd)

    def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        calls.append("replace")
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    save_arrays(tmp_path / "ckpt.safetensors", {"w": np.ones(3, np.float32)}, {})
    assert calls == ["fsync file", "replace", "fsync directory"]
    assert arrays_module.load_arrays(tmp_path / "ckpt.safetensors")[1]["w"].tolist() == [1.0, 1.0, 1.0]
