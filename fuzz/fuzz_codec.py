"""Coverage-guided fuzzing of everything srl decodes from a broker or the board (atheris / libFuzzer).

    pip install atheris
    python fuzz/fuzz_codec.py fuzz/corpus -max_total_time=600     # seeds itself when the folder is empty

Inputs that start with ``{`` are task configs (what a node reads from the board and builds);
the rest are messages, decoded as a batch (against DQN's schema) and as params, signed and not.
An "escape" is any exception other than DecodeError (codec) or TaskConfigError/TaskTrustError (task
config): libFuzzer stops and writes the input as crash-<sha1>. Not part of CI (it runs for as long as
it is given); the hypothesis property tests in tests/test_codec.py are its bounded cousin, and
tests/test_fuzz_target.py keeps this target starting (its seeds pass, their mutations only refuse).
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

try:
    import atheris
except ImportError:  # the seeds and the target still import (tests/test_fuzz_target.py runs them)
    atheris = None

with atheris.instrument_imports() if atheris is not None else contextlib.nullcontext():
    import numpy as np

    import srl
    from srl.algorithms import dqn
    from srl.base.env import EnvConfig
    from srl.base.rollout import Rollout
    from srl.runner.distribution.settings.task import TaskConfigError, TaskTrustError, build_task
    from srl.runner.distribution.wire.codec import BatchHeader, Codec, DecodeError

SPEC = srl.Runner("Pendulum-v1", dqn.Config()).spec
SCHEMA = dqn.Config().schema(SPEC)
UNSIGNED = Codec(secret="", task="fuzz", max_bytes=1 << 20)
SIGNED = Codec(secret="k", task="fuzz", max_bytes=1 << 20)
NO_MODULES: frozenset[str] = frozenset()


def seeds() -> list[bytes]:
    """Real rows of the algorithm's own worker (so the fuzzer starts from what passes validation)."""
    config = dqn.Config()
    runner = srl.Runner("Pendulum-v1", config)
    worker = config.make_worker(SPEC, runner.parameter, 0, 1, 0)
    with Rollout(EnvConfig("Pendulum-v1"), worker, config.envs_per_actor, seed=0) as rollout:
        while worker.pending() < 4:
            rollout.step()
    taken = worker.take()
    assert taken is not None
    columns = {name: column[:4] for name, column in taken.items()}
    header = BatchHeader("actor-1", 0, 1, 7, 3, 4, time.time())
    compressed = Codec(secret="", task="fuzz", compress=True)
    config = srl.Runner("Pendulum-v1", dqn.Config()).task_config()
    return [
        UNSIGNED.encode_batch(header, columns, np.ones(4, np.float32)),
        compressed.encode_batch(header, columns, None),
        UNSIGNED.encode_params({"q.w": np.ones((2, 3), np.float32)}, {"epoch": 1, "version": 2}),
        json.dumps({**config, "actor_num": 2, "max_train_count": 10, "queue": {"scheme": "redis"}}).encode(),
    ]


def one_input(data: bytes) -> None:
    if data[:1] == b"{":
        try:
            build_task(data.decode("utf-8", "replace"), "", UNSIGNED, allow_modules=NO_MODULES)
        except (TaskConfigError, TaskTrustError):
            pass
        return
    for codec in (UNSIGNED, SIGNED):
        try:
            codec.decode_batch(data, SCHEMA)
        except DecodeError:
            pass
        try:
            codec.decode_params(data, epoch=1, version=2)
        except DecodeError:
            pass


if __name__ == "__main__":
    if atheris is None:
        sys.exit("fuzzing needs atheris: pip install atheris")
    for arg in sys.argv[1:]:
        folder = Path(arg)
        if not arg.startswith("-") and (not folder.exists() or not any(folder.iterdir())):
            folder.mkdir(parents=True, exist_ok=True)
            for i, seed in enumerate(seeds()):
                (folder / f"seed-{i}").write_bytes(seed)
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
