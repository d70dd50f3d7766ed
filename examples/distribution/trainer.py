"""Run on the GPU machine (a notebook too): train one task, then return.

    python examples/distribution/trainer.py
"""

import os

from srl.runner.distribution import RedisParameters, trainer_run_forever

trainer_run_forever(RedisParameters(host=os.environ.get("SRL_REDIS_HOST", "localhost")), None, run_once=True)
