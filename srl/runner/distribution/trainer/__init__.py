"""The trainer role: the lease and the loop, ingest, versions, publisher, checkpoints.

Owns ``trainer_run_forever``; must never ack a batch before it is in memory and counted.
"""
