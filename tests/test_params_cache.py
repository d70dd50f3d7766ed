"""Params shared by the actors of one machine: fetched from the board once per version."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from srl.runner.distribution.actor.params_cache import LOCK_STALE_S, ParamsCache, private_directory
from srl.runner.distribution.board.board import ParamsRecord
from tests.full_disk import run_with_full_disk


class Board:
    """Stands in for the board's get_params: counts fetches (the cache's only contact with Redis)."""

    def __init__(self, version: int = 3) -> None:
        self.fetches = 0
        self.version = version
        self.lock = threading.Lock()

    def fetch(self) -> ParamsRecord:
        with self.lock:
            self.fetches += 1
        time.sleep(0.05)  # a 7 MB read takes a while: the others find the lock taken
        return ParamsRecord(1, self.version, 100 * self.version, b"weights v%d" % self.version)


def test_a_version_is_fetched_once_per_machine_and_read_by_every_other_actor(tmp_path: Path) -> None:
    board = Board()
    caches = [ParamsCache(tmp_path, "redis://h:6379/0 task-1") for _ in range(8)]
    got: list[ParamsRecord | None] = [None] * 8
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, caches[i].get((1, 3), board.fetch)))
               for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert board.fetches == 1
    assert all(r == ParamsRecord(1, 3, 300, b"weights v3") for r in got)
    assert sum(c.fetched for c in caches) == 1 and sum(c.shared for c in caches) == 7
    # a newer version replaces the older file; another task on the same machine shares nothing with this one
    board.version = 4
    assert caches[0].get((1, 4), board.fetch) == ParamsRecord(1, 4, 400, b"weights v4")
    assert caches[1].get((1, 4), board.fetch) is not None and board.fetches == 2
    assert len(list(tmp_path.glob("params-*.bin"))) == 1
    other = ParamsCache(tmp_path, "redis://h:6379/0 task-2")
    assert other.get((1, 4), board.fetch) is not None and board.fetches == 3


def test_a_lock_left_by_a_dead_fetcher_is_taken_over(tmp_path: Path) -> None:
    board = Board()
    cache = ParamsCache(tmp_path, "k", wait_s=60.0)
    lock = cache._path(1, 3).with_suffix(".lock")
    lock.touch()
    old = time.time() - LOCK_STALE_S - 1
    os.utime(lock, (old, old))
    assert cache.get((1, 3), board.fetch) is not None and board.fetches == 1
    assert not lock.exists()
    # a live lock whose holder is slow: fetched directly once the wait is over
    lock.touch()
    quick = ParamsCache(tmp_path, "k", wait_s=0.1)
    board.version = 5
    assert quick.get((1, 5), board.fetch) is not None and board.fetches == 2


def test_a_directory_others_may_write_to_is_not_used(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    assert private_directory(mine) == mine and (mine.stat().st_mode & 0o777) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    assert private_directory(shared) is None


def test_records_of_tasks_whose_actors_died_are_removed_after_an_hour(tmp_path: Path) -> None:
    from srl.runner.distribution.actor.params_cache import LEFT_OVER_S

    board = Board()
    dead = ParamsCache(tmp_path, "a task whose actors died")
    assert dead.get((1, 3), board.fetch) is not None
    left = next(tmp_path.glob("params-*.bin"))
    fresh = ParamsCache(tmp_path, "a task still running")
    assert fresh.get((1, 3), board.fetch) is not None
    assert left.exists()  # younger than an hour: perhaps its actors are only slow
    old = time.time() - LEFT_OVER_S - 1
    os.utime(left, (old, old))
    board.version = 4
    assert fresh.get((1, 4), board.fetch) is not None
    assert not left.exists() and len(list(tmp_path.glob("params-*.bin"))) == 1
    fresh.clear()
    assert not list(tmp_path.glob("params-*.bin"))


def test_a_record_that_does_not_fit_leaves_no_file_and_the_actor_goes_on(tmp_path: Path) -> None:
    done = run_with_full_disk("""
        record = ParamsRecord(1, 3, 300, b"w" * 65536)  # more than the 4 KiB the child's files may hold
        got = ParamsCache(Path(sys.argv[1]), "k").get((1, 3), lambda: record)
        assert got == record, got
        print("fetched", got.version)
    """, str(tmp_path), setup="""
        import logging, sys
        from pathlib import Path
        from srl.runner.distribution.board.board import ParamsRecord
        from srl.runner.distribution.actor.params_cache import ParamsCache
        logging.basicConfig(level=logging.WARNING)
    """)
    assert done.returncode == 0 and "fetched 3" in done.stdout, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "a partial record stays in the directory"
    assert "cannot share params version 3 on this machine" in done.stderr, done.stderr
    assert "File too large" in done.stderr and str(tmp_path) in done.stderr, done.stderr  # what failed, and where


def test_a_temporary_file_left_by_a_writer_that_died_is_removed_with_its_lock(tmp_path: Path) -> None:
    board = Board()
    cache = ParamsCache(tmp_path, "k")
    mine = tmp_path / f".{cache._path(1, 2).name}.99999.tmp"  # killed while writing
    theirs = tmp_path / ".params-0123456789abcdef-000000000001-000000000002.bin.99998.tmp"  # another task's
    young = tmp_path / f".{cache._path(1, 3).name}.99997.tmp"  # perhaps still being written
    for path in (mine, theirs, young):
        path.write_bytes(b"partial")
    stale = time.time() - LOCK_STALE_S - 1  # a lock this old is taken over: its holder died
    for path in (mine, theirs):
        os.utime(path, (stale, stale))
    assert cache.get((1, 3), board.fetch) is not None
    assert not mine.exists() and not theirs.exists()
    assert young.exists()


def test_an_unreadable_record_is_a_miss(tmp_path: Path) -> None:
    board = Board()
    cache = ParamsCache(tmp_path, "k")
    cache._path(1, 3).write_bytes(b"garbage")
    assert cache.get((1, 3), board.fetch) == ParamsRecord(1, 3, 300, b"weights v3") and board.fetches == 1


@pytest.mark.slow
def test_the_actors_of_one_machine_share_params_in_a_run(redis_url: str, namespace: str, tmp_path: Path) -> None:
    import srl
    from srl.runner.distribution import RedisParameters
    from srl.runner.distribution.board.board import TaskState
    from tests.nodes import board_for, tiny_config

    runner = srl.Runner("Pendulum-v1", tiny_config())
    runner.train_distribution(RedisParameters(url=redis_url, task_name=namespace), actor_num=2, max_train_count=300,
                              progress_interval=None, local_processes=True,
                              actor_options={"batch_size": 64, "batch_max_age": 0.2,
                                             "params_cache_dir": str(tmp_path)})
    board = board_for(redis_url, namespace)
    status = board.get_status()
    assert status is not None and status.status == TaskState.END
    actors = [s for role, s in board.get_all_stats().items() if role.startswith("actor")]
    assert len(actors) == 2 and sum(int(s["params_shared"]) for s in actors) > 0  # one read what the other fetched
    assert not list(tmp_path.glob("params-*.bin")), "the actors leave no records behind"
    board.delete_task()


def test_float16_params_while_the_run_goes_on_and_float32_at_its_end() -> None:
    import numpy as np
    import torch

    from srl.algorithms import dqn
    from srl.base.env import EnvConfig, env_spec
    from srl.runner.distribution.trainer.publisher import Publisher, half_precision
    from srl.runner.distribution.trainer.versions import VersionGate
    from srl.runner.distribution.wire.codec import Codec

    spec = env_spec(EnvConfig("CartPole-v1"))
    config = dqn.Config()
    parameter = config.make_parameter(spec, torch.device("cpu"))
    codec = Codec(task="t")
    gate = VersionGate(config.data_path())
    publisher = Publisher(None, codec, "uid", 1, parameter, "dqn", gate, 0.0, lambda: False,  # type: ignore[arg-type]
                          float16=True)
    gate.version = 1
    publisher.request(10)
    assert publisher._pending is not None
    _, sent = codec.decode_params(publisher._pending[2])
    full = parameter.to_arrays()
    assert all(sent[k].dtype == np.float16 for k in full if full[k].dtype == np.float32)
    assert sum(a.nbytes for a in sent.values()) < 0.6 * sum(a.nbytes for a in full.values())
    other = config.make_parameter(spec, torch.device("cpu"))
    other.from_arrays(sent)  # loaded into float32 weights, within float16's precision
    for name, array in other.to_arrays().items():
        assert array.dtype == full[name].dtype
        np.testing.assert_allclose(array, full[name], rtol=1e-3, atol=1e-4)
    assert publisher.request_final(20)
    _, last = codec.decode_params(publisher._pending[2])
    assert all(last[k].dtype == full[k].dtype for k in full)
    # a weight beyond float16's range keeps float32 (it would become infinite)
    kept = half_precision({"big": np.array([1e6], np.float32), "small": np.array([1.0], np.float32)})
    assert kept["big"].dtype == np.float32 and kept["small"].dtype == np.float16
