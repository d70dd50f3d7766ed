"""Single-process training: DQN on Pendulum-v1, then an evaluation.

    python examples/train_local.py
"""

import numpy as np

import srl
from srl.algorithms import dqn

rl_config = dqn.Config()
rl_config.hidden_block.set_mlp((64, 64))
rl_config.memory.set_proportional_memory()
rl_config.memory.capacity = 5000

runner = srl.Runner("Pendulum-v1", rl_config)
runner.train(max_train_count=20_000)
rewards = runner.evaluate()
print(f"evaluation mean over {len(rewards)} episodes: {np.mean(rewards):.1f}")
