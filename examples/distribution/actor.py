"""Run on each actor machine: serve tasks from the Redis board until Ctrl-C.

    python examples/distribution/actor.py                     # Redis on localhost
    SRL_REDIS_HOST=10.0.0.5 python examples/distribution/actor.py

The board comes from SRL_REDIS_URL or SRL_REDIS_HOST, its password from SRL_REDIS_PASSWORD (never a
command line), the experience queue from SRL_QUEUE_URL (default: the board's Redis), the shared secret
from SRL_SECRET.
"""

import os

from srl.runner.distribution import RedisParameters, actor_run_forever

actor_run_forever(RedisParameters.from_env(), os.environ.get("SRL_QUEUE_URL") or None)
