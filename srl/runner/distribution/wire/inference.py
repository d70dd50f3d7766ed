"""The central inference protocol: what a request and a reply carry, and the errors an actor's connection
ends with (the frames that carry them are ``wire/link.py``'s).

Owns what the inference server and the actor's client both speak; must never trust a peer: every message
either way is an srl codec batch checked against these schemas (``srl.runner.distribution.wire.codec``).
"""

from __future__ import annotations

from srl.base.env import VALUE_BOUND, DiscreteActions, EnvSpec, MultiDiscreteActions
from srl.base.schema import Column, Schema
from srl.runner.distribution.settings.credentials import CredentialsError
from srl.runner.distribution.wire.codec import batch_message_bytes


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
