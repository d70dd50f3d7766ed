"""The safetensors container of params and checkpoints: files that are replaced whole, durably, leaving
nothing behind when the disk is full."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
import pytest

from srl.base import arrays as arrays_module
from srl.base.arrays import load_arrays, save_arrays
from tests.full_disk import run_with_full_disk


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
