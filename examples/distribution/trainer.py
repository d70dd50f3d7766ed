"""Run on the GPU machine (a notebook too): train one task, then return.

    python examples/distribution/trainer.py

The board comes from SRL_REDIS_URL or SRL_REDIS_HOST, its password from SRL_REDIS_PASSWORD, the
experience queue from SRL_QUEUE_URL (default: the board's Redis), the shared secret from SRL_SECRET.
"""

import os

from srl.runner.distribution import RedisParameters, trainer_run_forever

trainer_run_forever(RedisParameters.from_env(), os.environ.get("SRL_QUEUE_URL") or None, run_once=True)
