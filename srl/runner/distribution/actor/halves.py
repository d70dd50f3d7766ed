"""An actor's envs in two halves under central inference: double buffering, as Sample Factory's samplers do.

Owns :class:`Halves`: two ``Rollout``s of half the actor's envs, each with its own ``InferenceClient`` (a
connection and a session of its own on the server), stepped in turn. A half's next request goes as soon as
its step ends (``Worker.ahead``), so the other half steps its envs while that request is on its way and its
actions come back: the round trip overlaps stepping instead of adding to it. Must never: restart the episodes
of a half whose connection did not break, or step a half again before the other (the order is the overlap).

The loop, one half's step at a time::

    a: actions of A's request (sent at the end of A's last step) -> A's envs step -> A's next request goes
    b: actions of B's request (on its way while A stepped)      -> B's envs step -> B's next request goes
"""

from __future__ import annotations

from collections.abc import Collection

from srl.base.env import EnvSpec
from srl.base.rollout import Episode, Rollout
from srl.runner.distribution.actor.inference_client import InferenceClient
from srl.runner.distribution.board.board import Board
from srl.runner.distribution.node.stop import StopFlag
from srl.runner.distribution.settings.task import TaskSpec
from srl.runner.distribution.wire.codec import Codec
from srl.runner.distribution.wire.inference import InferenceLostError


def central_rollout(task: TaskSpec, board: Board, spec: EnvSpec, slot: int, sender: str, tag: int, codec: Codec,
                    stop: StopFlag, ca_file: str | None, seed: int | None, allow: Collection[str] | None
                    ) -> tuple[InferenceClient | Halves, Rollout | Halves, InferenceClient]:
    """A central actor's client, the rollout it acts in (one of every env, or with ``double_buffer`` the
    two :class:`Halves`: envs 0..E/2-1 and E/2..E-1, seeded as the one rollout would seed them) and the worker
    the actor asks for rows and stats (a client: it has none)."""
    config = task.rl_config
    envs = config.envs_per_actor // task.halves
    clients = [InferenceClient(board, spec, envs, slot, sender, tag, codec, stop, ca_file, task.inference_servers,
                               half, task.halves) for half in range(task.halves)]
    rollouts: list[Rollout] = []
    try:
        for half, client in enumerate(clients):
            rollouts.append(Rollout(task.env_config, client, envs, None if seed is None else seed + half * envs,
                                    config.vectorization, allow))
    except BaseException:
        for rollout in rollouts:
            rollout.close()
        raise
    if task.halves == 1:
        return clients[0], rollouts[0], clients[0]
    halves = Halves(rollouts, clients)
    return halves, halves, clients[0]


class Halves:
    """Two halves of an actor's envs, each ``rollouts[h]`` acting through ``clients[h]``; ``step`` steps the
    next half (its episodes), as ``Rollout.step`` steps every env."""

    def __init__(self, rollouts: list[Rollout], clients: list[InferenceClient]) -> None:
        self.rollouts = rollouts
        self.clients = clients
        self.num_envs = sum(r.num_envs for r in rollouts)
        """every env of the actor"""
        self.envs_per_step = rollouts[0].num_envs
        """the envs one ``step`` steps: a half"""
        self._next = 0
        self._lost: int | None = None
        """the half whose connection broke last (its episodes start again at ``restart``)"""
        for client in clients:
            client.send_ahead = True

    def step(self) -> list[Episode]:
        half = self._next
        try:
            episodes = self.rollouts[half].step()
        except InferenceLostError:
            self._lost = half  # the same half goes next: the other one's request may still be on its way
            raise
        self._next = 1 - half
        offset = half * self.envs_per_step
        return [Episode(e.env_index + offset, e.total_reward, e.length) for e in episodes] if half else episodes

    @property
    def episodes_lost(self) -> bool:
        """The half whose connection broke had acted: its episodes must start again."""
        return self._lost is not None and self.clients[self._lost].episodes_lost

    def restart(self) -> None:
        """Start the episodes of the half whose connection broke (both, when none did)."""
        for half in [self._lost] if self._lost is not None else [0, 1]:
            self.rollouts[half].restart()
        self._lost = None

    @property
    def params_version(self) -> int:
        return max(client.params_version for client in self.clients)

    @property
    def connected_to(self) -> str:
        return " and ".join(sorted({c.connected_to for c in self.clients if c.connected_to}))

    @property
    def reconnects(self) -> int:
        return sum(client.reconnects for client in self.clients)

    def close(self) -> None:
        for rollout in self.rollouts:
            rollout.close()
        for client in self.clients:
            client.close()
