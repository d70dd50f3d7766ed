"""Run on each actor machine: serve tasks from the Redis board until Ctrl-C.

    python examples/distribution/actor.py            # Redis on localhost
    SRL_REDIS_HOST=10.0.0.5 python examples/distribution/actor.py
"""

import os

from srl.runner.distribution import RedisParameters, actor_run_forever

actor_run_forever(RedisParameters(host=os.environ.get("SRL_REDIS_HOST", "localhost")), None)
