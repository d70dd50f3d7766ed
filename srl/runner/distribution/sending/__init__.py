"""Rows to the experience queue: batches, backpressure, resends, and what is in flight.

Owns the sender the actor and the inference server share; must never drop a batch.
"""
