"""The Redis blackboard: Board, and its parts (tasks, leases, params, accounts, journal), each owning its keys.

Owns the key layout, the Lua scripts and the one bounded reader of values; must never be bypassed: no other
module writes a board key.
"""
