"""The central inference role: the gRPC server and its sessions.

Owns ``inference_run_forever``; must never act with weights from two versions in one batch.
"""
