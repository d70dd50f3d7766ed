"""Reusable reinforcement-learning parts that algorithms build from (replay memories).

Must never: import anything distributed (Redis, queues, codecs); algorithms
and the trainer use these parts the same way in one process or many.
"""
