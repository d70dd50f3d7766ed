"""The bytes between nodes: the frame (magic, version, HMAC, compression), batches, params, requests.

Owns encoding and decoding; must never run code chosen by what it decodes (no pickle).
"""
