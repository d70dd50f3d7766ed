"""The central inference role: the actors' connections (``streams``), their sessions (``session``), the batcher and the
run.

Owns ``inference_run_forever``; must never act with weights from two versions in one batch.
"""
