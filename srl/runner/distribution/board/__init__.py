"""The Redis blackboard: every key of a task, the Lua scripts, and the one bounded reader of values.

Owns the key layout; must never be bypassed: no other module writes a board key.
"""
