"""The central inference protocol: the one gRPC method, what a request and a reply carry, the channel's
options, and the errors an actor's stream ends with.

Owns what the inference server and the actor's client both speak; must never trust a peer: every message
either way is an srl codec batch checked against these schemas (``srl.runner.distribution.wire.codec``).
"""

from __future__ import annotations

from typing import Any

from srl.base.env import VALUE_BOUND, DiscreteActions, EnvSpec, MultiDiscreteActions
from srl.base.schema import Column, Schema
from srl.runner.distribution.settings.credentials import CredentialsError
from srl.runner.distribution.wire.codec import batch_message_bytes

METHOD = "/srl.Inference/Act"
"""the one gRPC method: a bidirectional stream of requests and replies (raw bytes: srl codec batches)"""


class InferenceLostError(ConnectionError):
    """The stream to the inference server broke (it stopped, or was replaced): episodes restart."""


class InferenceRefusedError(CredentialsError):
    """The inference server refused this actor (a secret or an srl version it does not share)."""


def request_schema(spec: EnvSpec) -> Schema:
    """One row per env: what it observes now, and what followed the previous action (its reward, whether
    the episode terminated or was truncated, its final observation then, whether a new episode started)."""
    return Schema({
        "obs": spec.obs_column(),
        "final_obs": spec.obs_column(),
        "reward": Column("float32", (), low=-VALUE_BOUND, high=VALUE_BOUND),
        "terminated": Column("bool"),
        "truncated": Column("bool"),
        "started": Column("bool"),
    })


def max_request_bytes(spec: EnvSpec, envs: int) -> int:
    """The largest request an actor of ``envs`` envs sends (the columns, and room for the header)."""
    return batch_message_bytes(request_schema(spec), envs) + 65536


def reply_schema(spec: EnvSpec) -> Schema:
    """One row per env: its action as the env takes it (an index, indices, or floats)."""
    actions = spec.actions
    if isinstance(actions, DiscreteActions):
        return Schema({"action": Column("int64", (), low=0, high=actions.n - 1)})
    if isinstance(actions, MultiDiscreteActions):
        return Schema({"action": Column("int64", (len(actions.nvec),), low=0, high=max(actions.nvec) - 1)})
    return Schema({"action": Column("float32", tuple(actions.shape), low=-VALUE_BOUND, high=VALUE_BOUND)})


KEEPALIVE_MS = 10_000
"""HTTP/2 pings on an idle or waiting stream: a peer that stops answering them (its host gone, its process
frozen) is dropped ``KEEPALIVE_MS + KEEPALIVE_TIMEOUT_MS`` later, and an actor goes to the standby"""
KEEPALIVE_TIMEOUT_MS = 5_000


def grpc_options(max_bytes: int) -> list[tuple[str, Any]]:
    return [("grpc.max_receive_message_length", max_bytes), ("grpc.max_send_message_length", max_bytes),
            ("grpc.so_reuseport", 0), ("grpc.keepalive_time_ms", KEEPALIVE_MS),
            ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS), ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_MS // 2)]
