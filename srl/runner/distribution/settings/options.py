"""What a node (actor or trainer) may be told on its command line or in its ``*_run_forever`` call.

Owns: ``NodeOptions`` and its two kinds, ``ActorOptions`` and ``TrainerOptions``: typed settings
with a docstring under each field, which ``srl actor`` / ``srl trainer`` turn into options and the
client checks before it starts local nodes. Must never: hold a connection or run anything.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import uuid
from dataclasses import dataclass
from typing import Any

from srl.base.config import Settings, check_int, check_number
from srl.runner.distribution.settings.redis_parameters import read_secret_file
from srl.runner.distribution.wire.codec import Codec


@dataclass
class NodeOptions(Settings):
    """Settings every node (actor or trainer) has."""

    heartbeat_interval: float = 1.0
    """seconds between lease renewals (each also reports stats)"""
    lease_ttl: float = 5.0
    """seconds a lease stays held without a renewal"""
    task_poll_interval: float = 1.0
    """seconds between looks for a task while idle"""
    secret: str | None = dataclasses.field(default=None, repr=False)
    """shared secret that signs messages and the task config (default: secret_file, else env
    SRL_SECRET, else the file named by SRL_SECRET_FILE); never given on a command line"""
    secret_file: str = ""
    """file holding the shared secret (its first line)"""
    allow_env_modules: str = ""
    """comma-separated modules a 'module:Env' env id may import on this node (also env
    SRL_ALLOW_ENV_MODULES); by default none: env ids from the board never import code"""
    run_once: bool = False
    """return once the task it served has ended, instead of waiting for the next (after losing its
    lease, e.g. to a pause longer than the TTL, it stands by for the same task)"""
    uid: str = ""
    """this process's name on the board (default: role-host-pid-random)"""
    max_start_s: float = 600.0
    """seconds a node keeps a just-claimed lease while it builds its run (imports, memory, a CUDA
    context, params to restore), before its heartbeats start; a start that hangs longer lets the lease
    lapse, so a standby takes the slot over"""

    def validate(self) -> None:
        """Raise ValueError naming a setting whose value no node can run with (the client checks the options
        of the nodes it starts with this before it writes anything; a node, before it serves)."""
        check_number("heartbeat_interval", self.heartbeat_interval, 0.0, 3600.0, low_open=True)
        check_number("lease_ttl", self.lease_ttl, 0.0, 86_400.0, low_open=True)
        if self.lease_ttl <= self.heartbeat_interval:
            raise ValueError(f"lease_ttl ({self.lease_ttl:g}s) must be longer than heartbeat_interval "
                             f"({self.heartbeat_interval:g}s): the lease would lapse between two renewals")
        check_number("task_poll_interval", self.task_poll_interval, 0.0, 3600.0, low_open=True)
        check_number("max_start_s", self.max_start_s, 0.0, 86_400.0, low_open=True)

    def set_default_uid(self, role: str) -> None:
        if not self.uid:
            self.uid = f"{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"

    def codec(self, task_name: str, **kwargs: Any) -> Codec:
        """The codec for ``task_name`` with this node's secret."""
        secret = self.secret if self.secret is not None else read_secret_file(self.secret_file)
        return Codec(secret=secret, task=task_name, **kwargs)


@dataclass
class ActorOptions(NodeOptions):
    """How an actor process behaves (the task itself comes from the board)."""

    batch_size: int = 256
    """transitions per message sent to the queue (at most the task's message bound; segments go as
    soon as they are complete)"""
    batch_max_age: float = 1.0
    """seconds a partly filled batch may wait before it is sent anyway"""
    send_ahead: int = 4
    """batches a sending thread may hold while the actor acts on: the thread reads the queue's depth and
    puts every batch waiting in one call, so a broker a long round trip away costs the acting loop
    nothing until this many are unsent (0: the acting loop sends each batch itself, two round trips)"""
    params_poll_interval: float = 0.1
    """seconds between checks of the params version on the board (one HMGET) while acting"""
    params_wait_poll_interval: float = 0.01
    """the same while the actor waits for a version to act with (sync PPO's lockstep, the first
    params): the wait is idle time, so the new version is picked up within this"""
    params_cache_dir: str | None = None
    """where the actors of one machine share the params versions they fetch (each is fetched from Redis once
    per machine); unset: /dev/shm/srl-<uid> (memory); "": every actor fetches its own"""
    compress: bool | None = None
    """zstd-compress batches; unset: when the task's rows hold images (frames compress several times over;
    float vectors barely do and pay the CPU)"""
    inference_ca_file: str = ""
    """with central inference over TLS: the CA bundle that signed the inference server's certificate
    (default: the board's ssl_ca_certs, else the system's roots)"""
    central_nice: int = 10
    """with central inference: how much the acting thread lowers its CPU priority (Unix nice), so that on a
    machine it shares with its inference server, the server, which every actor waits on, gets the core it
    needs (0: keep it; an actor on a machine of its own loses nothing by it). 2-core machine, 4 actors x 32
    MinAtar envs, one run: central / local 0.65 at 0, 0.72 at 10 (docs/benchmarks.md)"""

    def validate(self) -> None:
        super().validate()
        check_int("batch_size", self.batch_size, 1, 1 << 20)
        check_number("batch_max_age", self.batch_max_age, 0.0, 3600.0, low_open=True)
        check_int("send_ahead", self.send_ahead, 0, 1024)
        check_int("central_nice", self.central_nice, 0, 19)
        check_number("params_poll_interval", self.params_poll_interval, 0.0, 3600.0, low_open=True)
        check_number("params_wait_poll_interval", self.params_wait_poll_interval, 0.0, 3600.0, low_open=True)


@dataclass
class InferenceOptions(NodeOptions):
    """How a central inference server behaves (the task itself comes from the board)."""

    listen: str = "0.0.0.0:0"
    """host:port the server listens on (port 0: any free one; the board tells actors which)"""
    advertise_host: str = ""
    """the host name or address actors reach the server at (default: the listen host, or this machine's
    name when it listens on every interface)"""
    max_batch_envs: int = 0
    """most envs one forward pass acts for (0: every env of every actor)"""
    max_wait_ms: float = 0.0
    """longest a request waits for others to join its batch (a batch goes at once when every connected
    actor has a request in it, or it is full). 0: a batch is what came while the last one was acted for, as
    Sample Factory's policy workers take it (here, 4 actors x 32 MinAtar envs: 0.66 of local inference's steps/s
    against 0.56 at 2 ms, the medians of 3 turns of ``bench/inference.py``)"""
    batch_size: int = 256
    """transitions per message sent to the queue (segments go as soon as they are complete)"""
    batch_max_age: float = 1.0
    """seconds an actor's partly filled batch of rows may wait before it is sent anyway"""
    params_poll_interval: float = 0.05
    """seconds between checks of the params version on the board (one HMGET)"""
    tls_cert_file: str = ""
    """PEM certificate (chain) the server shows actors; with tls_key_file, it serves over TLS (required
    when the board is reached over TLS)"""
    tls_key_file: str = ""
    """PEM private key of tls_cert_file"""
    compress: bool | None = None
    """zstd-compress batches of rows; unset: when the task's rows hold images"""
    torch_threads: int = 0
    """torch CPU threads for the server's forward passes (0: the task's torch_threads, what its actors use):
    a server on a CPU with cores to spare batches faster with more"""

    def validate(self) -> None:
        super().validate()
        check_int("torch_threads", self.torch_threads, 0, 256)
        check_int("max_batch_envs", self.max_batch_envs, 0, 1 << 20)
        check_number("max_wait_ms", self.max_wait_ms, 0.0, 10_000.0)
        check_int("batch_size", self.batch_size, 1, 1 << 20)
        check_number("batch_max_age", self.batch_max_age, 0.0, 3600.0, low_open=True)
        check_number("params_poll_interval", self.params_poll_interval, 0.0, 3600.0, low_open=True)
        host, _, port = self.listen.rpartition(":")
        if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ValueError(f"listen must be host:port (port 0: any free one), got {self.listen[:80]!r}")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("tls_cert_file and tls_key_file go together: give both (TLS) or neither")


@dataclass
class TrainerOptions(NodeOptions):
    """How a trainer process behaves (the task itself comes from the board)."""

    min_publish_interval: float = 0.05
    """seconds between params publications at least (the algorithm sets the cadence in train steps;
    this keeps a very fast trainer from writing params hundreds of times a second)"""
    params_float16: bool = False
    """publish float32 weights as float16 while the run goes on (half the bytes out of Redis per version, for
    acting only); the run's last params and its checkpoints keep float32, and each version's float32 weights
    go beside the float16 ones for a trainer that takes the run over"""
    ingest_max_messages: int = 16
    """batches fetched from the queue per round trip (with the task's message size, this bounds
    the bytes one read may bring; a broker that pushes may hold twice as many unacked)"""
    max_buffer_bytes: int = 0
    """largest buffer (replay memory) this trainer allocates for a task (0: 75% of this machine's
    memory); a task asking for more ends FAILED with the reason"""
    train_ahead: float = 2.0
    """an off-policy trainer makes at most this many times the train steps its data path's replay ratio
    gives the rows it received (then waits for new rows): a queue or board that stops delivering, or actors
    that are gone, do not make it replay the same memory without end"""
    checkpoint_dir: str = ""
    """write checkpoints (weights, optimizer state, counters; safetensors) of each task under
    CHECKPOINT_DIR/TASK_NAME/ every checkpoint_interval seconds and when the task ends ('': none); a client
    with a log_dir receives them through the board whatever this is"""
    checkpoint_interval: float = 600.0
    """seconds between periodic checkpoints"""
    keep_checkpoints: int = 5
    """periodic checkpoints kept per task (the newest)"""

    def validate(self) -> None:
        super().validate()
        check_number("min_publish_interval", self.min_publish_interval, 0.0, 3600.0)
        check_int("ingest_max_messages", self.ingest_max_messages, 1, 4096)
        check_int("max_buffer_bytes", self.max_buffer_bytes, 0, 1 << 50)
        if not (isinstance(self.train_ahead, (int, float)) and not isinstance(self.train_ahead, bool)
                and math.isfinite(self.train_ahead) and self.train_ahead >= 1.0):
            raise ValueError(f"train_ahead must be a number >= 1 (the replay ratio itself, or looser), got "
                             f"{self.train_ahead!r}: below it a trainer would wait for rows its actors wait to send")
        check_number("checkpoint_interval", self.checkpoint_interval, 0.0, 1e7, low_open=True)
        check_int("keep_checkpoints", self.keep_checkpoints, 1, 1_000_000)

    @property
    def prefetch(self) -> int:
        """Unacked messages a broker that pushes (RabbitMQ, MQTT) may send the trainer: three reads'
        worth: the read whose count is being written to the board (it is acked once written), the one
        being inserted, and the next, which comes meanwhile instead of after an ack (RabbitMQ, 16 rows a
        message: two reads' worth cost a quarter of the ingest rate once reads were acked after their
        count, three an eighth)."""
        return 3 * self.ingest_max_messages
