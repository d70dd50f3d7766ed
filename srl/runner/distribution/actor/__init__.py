"""The actor role: the env loop, its pacing (replay ratio, step budget) and its params.

Owns ``actor_run_forever``; must never drop experience silently.
"""
