"""Central inference (SEED RL): one server acts for every actor; actors only step envs.

In-process tests run a real ``InferenceRun`` (its frames over loopback TCP, the board and queue in a real Redis) and
talk to it with the actor's own ``InferenceClient``; the end-to-end tests run real processes.
"""

from __future__ import annotations

import contextlib
import json
import math
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import srl
from srl.algorithms import dqn, impala, ppo, r2d2, sac
from srl.base.env import EnvConfig, env_spec
from srl.base.rl import RLConfig, Worker, join_policy_io, split_policy_io
from srl.runner.distribution import RedisParameters
from srl.runner.distribution.actor.inference_client import InferenceClient
from srl.runner.distribution.board.board import Board, TaskState, inference_lease
from srl.runner.distribution.inference.run import InferenceRun
from srl.runner.distribution.node.stop import StopFlag
from srl.runner.distribution.queues import open_queue
from srl.runner.distribution.settings.options import ActorOptions, InferenceOptions
from srl.runner.distribution.settings.task import TaskSpec, build_task
from srl.runner.distribution.wire.codec import BatchHeader, Codec, task_tag
from srl.runner.distribution.wire.inference import InferenceLostError, InferenceRefusedError
from srl.runner.distribution.wire.link import HELLO, ClientLink, Refusal, Status
from tests.nodes import ClientThread, board_for, lease_holder_pid, sigkill, start, thread_nices, wait_for


def _impala(**changes: Any) -> impala.Config:
    config = impala.Config(envs_per_actor=2, segment_length=8, seed=0)
    for k, v in changes.items():
        setattr(config, k, v)
    return config


# ------------------------------------------------------------------------------------ the worker seam


def _workers(config: RLConfig, env: str, n: int, weights: Any = None) -> tuple[list[Worker], Any, Any]:
    """``n`` workers sharing one parameter (with ``weights`` when given), each seeded alike."""
    spec = env_spec(EnvConfig(env))
    config = config.settled(EnvConfig(env))
    parameter = config.make_parameter(spec, torch.device("cpu"))
    if weights is not None:
        parameter.from_arrays(weights)
    return [config.make_worker(spec, parameter, i, n, seed=7) for i in range(n)], spec, parameter


@pytest.mark.parametrize(("config", "env"), [
    (dqn.Config(envs_per_actor=3), "CartPole-v1"), (ppo.Config(envs_per_actor=3), "CartPole-v1"),
    (ppo.Config(envs_per_actor=3, recurrent="lstm"), "CartPole-v1"), (r2d2.Config(envs_per_actor=3), "CartPole-v1"),
    (impala.Config(envs_per_actor=3, recurrent="gru"), "CartPole-v1"), (sac.Config(envs_per_actor=3), "Pendulum-v1"),
], ids=["dqn", "ppo", "ppo-lstm", "r2d2", "impala-gru", "sac"])
def test_one_forward_pass_for_many_workers_acts_as_each_alone(config: RLConfig, env: str) -> None:
    """The server's batch: the workers' inputs joined, one policy() call, each worker its rows back. The
    actions (same seeds) and every worker's state afterwards are those of acting alone."""
    alone, spec, parameter = _workers(config, env, 2)
    batched, _, _ = _workers(config, env, 2, parameter.to_arrays())
    rng = np.random.default_rng(0)
    for step in range(4):
        obs = [rng.normal(size=(3, *spec.obs_shape)).astype(np.float32) for _ in range(2)]
        if step == 0:
            for w, o in zip(alone + batched, obs + obs, strict=True):
                w.reset(np.arange(3), o)
        expected = [w.act(o) for w, o in zip(alone, obs, strict=True)]
        with torch.inference_mode():
            inputs = [w.policy_inputs(o) for w, o in zip(batched, obs, strict=True)]
            outputs = batched[0].policy(join_policy_io(inputs))
            got = [w.act_with(o, part) for w, o, part in
                   zip(batched, obs, split_policy_io(outputs, [3, 3]), strict=True)]
        for e, g in zip(expected, got, strict=True):
            if e.dtype.kind == "f":  # continuous actions: equal to a batch size's rounding
                np.testing.assert_allclose(e, g, rtol=1e-6, atol=1e-6)
            else:
                np.testing.assert_array_equal(e, g)
        for a, b in zip(alone, batched, strict=True):
            for name in ("_h", "_c", "_q", "_logprob", "_value"):
                if getattr(a, name, None) is not None:
                    np.testing.assert_allclose(np.asarray(getattr(a, name)), np.asarray(getattr(b, name)),
                                               rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------ a server in this process


@dataclass
class Served:
    run: InferenceRun
    board: Board
    task: TaskSpec
    redis_params: RedisParameters
    thread: threading.Thread
    secret: str | None

    def client(self, slot: int, secret: str | None = "same", uid: str | None = None) -> InferenceClient:
        """The actor's side for ``slot`` (its lease taken for ``uid``)."""
        uid = uid or f"actor-test-{slot}"
        self.board.claim_lease(f"actor:{slot}", uid, 60_000)
        codec = Codec(secret=self.secret if secret == "same" else secret, task=self.board.task_name)
        spec = self.run.spec
        return InferenceClient(self.board, spec, self.task.rl_config.envs_per_actor, slot, f"{uid}.0",
                               task_tag(self.board.task_id), codec, StopFlag(), servers=self.task.inference_servers)


def _publish(board: Board, config: RLConfig, spec: Any, codec: Codec) -> None:
    epoch = board.claim_trainer("trainer-test", 60_000)
    assert epoch is not None
    parameter = config.make_parameter(spec, torch.device("cpu"))
    blob = codec.encode_params(parameter.to_arrays(), {"epoch": epoch, "version": 1, "train_count": 0})
    assert board.publish_params("trainer-test", epoch, 1, blob, 0)


@pytest.fixture()
def serve_task(redis_url: str, namespace: str) -> Iterator[Any]:
    served: list[Served] = []

    def make(config: RLConfig, env: str = "CartPole-v1", actor_num: int = 3, secret: str | None = None,
             capacity: int = 1000, servers: int = 1, server: int = 0, double_buffer: bool = False,
             **options: Any) -> Served:
        """A server of a task (of ``servers``; the task is written by the first ``make`` of a test)."""
        redis_params = RedisParameters(url=redis_url, task_name=namespace)
        board = Board(redis_params.connect(), namespace)
        runner = srl.Runner(env, config)
        config_json = json.dumps({**runner.task_config(), "actor_num": actor_num, "max_steps": 10**9,
                                  "inference": "central", "queue": {"scheme": "redis", "capacity": capacity},
                                  **({"inference_servers": servers} if servers > 1 else {}),
                                  **({"double_buffer": True} if double_buffer else {})})
        codec = Codec(secret=secret, task=namespace)
        if served:
            board = served[0].board
        else:
            status = board.create_task(config_json, signature=codec.config_signature(config_json))
            board = board.bound(status.task_id)
            board.set_active()
        task = build_task(config_json, codec.config_signature(config_json), codec)
        opts = InferenceOptions(listen="127.0.0.1:0", uid=f"inference-test{'-' + str(len(served)) if served else ''}",
                                heartbeat_interval=0.2, lease_ttl=2.0, params_poll_interval=0.02, secret=secret,
                                batch_max_age=0.1, **options)
        assert board.claim_lease(inference_lease(server), opts.uid, 60_000)
        run = InferenceRun(board, redis_params, None, task, opts, server)
        if not served:
            _publish(board, task.rl_config, run.spec, codec)
        thread = threading.Thread(target=run.run, daemon=True)
        thread.start()
        wait_for(lambda: run.parameter.version == 1, 10, "the server to load params version 1")
        s = Served(run, board, task, redis_params, thread, secret)
        served.append(s)
        return s

    yield make
    for s in served:
        s.run.stop.set("test over")
        s.thread.join(timeout=10)
    if served:
        served[0].board.delete_task()


def _step(client: InferenceClient, obs: np.ndarray, steps: int) -> list[np.ndarray]:
    actions = []
    for _ in range(steps):
        actions.append(client.act(obs))
        client.observe(np.ones(client.num_envs, np.float32), obs, np.zeros(client.num_envs, bool),
                       np.zeros(client.num_envs, bool))
    return actions


def _obs(served: Served) -> np.ndarray:
    spec = served.run.spec
    return np.zeros((served.task.rl_config.envs_per_actor, *spec.obs_shape), spec.obs_dtype)


def test_concurrent_actors_share_batches_bounded_by_max_batch_envs(serve_task: Any) -> None:
    served = serve_task(_impala(), actor_num=3, max_batch_envs=4, max_wait_ms=200.0)  # two actors' envs at most
    clients = [served.client(slot) for slot in range(3)]
    errors: list[BaseException] = []

    def act(client: InferenceClient) -> None:
        try:
            actions = _step(client, _obs(served), 40)
            assert all(a.shape == (2,) and a.dtype == np.int64 and set(a.tolist()) <= {0, 1} for a in actions)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=act, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    run = served.run
    assert run.agent_steps == 3 * 40 * 2
    envs_per_batch = run.agent_steps / run.batches
    assert 2 < envs_per_batch <= 4  # batches formed, and never above max_batch_envs
    for c in clients:
        c.close()


def test_a_request_waits_at_most_max_wait_for_others(serve_task: Any) -> None:
    """Two actors connected, one of them silent: the other's requests go alone once max_wait_ms passed, and
    at once when every connected actor has a request in."""
    served = serve_task(_impala(), actor_num=2, max_wait_ms=300.0)
    quiet, busy = served.client(0), served.client(1)
    obs = _obs(served)
    quiet.act(obs)  # connected, then silent
    started = time.monotonic()
    _step(busy, obs, 3)
    waited = time.monotonic() - started
    assert waited >= 3 * 0.3  # each request waited for the silent actor, up to the bound
    assert waited < 3 * 0.3 + 5.0  # and then went alone
    quiet.close()  # one connected actor now: no waiting at all
    wait_for(lambda: len(served.run._sessions) == 1, 10, "the quiet actor's session to close")
    started = time.monotonic()
    _step(busy, obs, 3)
    assert time.monotonic() - started < 0.3
    busy.close()


def test_rows_the_server_writes_pass_the_trainers_schema(serve_task: Any) -> None:
    """IMPALA's segments assembled on the server: the task's schema, the slot as the batch's actor index,
    the params version acted with."""
    served = serve_task(_impala(), actor_num=2)
    client = served.client(1)
    _step(client, _obs(served), 8 * 3 + 1)  # what followed a step reaches the server with the next request
    consumer = open_queue(None, namespace=served.board.task_name, role="consumer",
                          redis_params=served.redis_params)
    codec = Codec(task=served.board.task_name)
    schema = served.task.rl_config.schema(served.run.spec)
    seen = 0
    deadline = time.monotonic() + 60  # a budget for a loaded machine: the loop ends once 3 came
    while seen < 3 and time.monotonic() < deadline:
        message = consumer.get(timeout=0.5)
        if message is None:
            continue
        header, columns, _ = codec.decode_batch(message.data, schema)
        assert header.actor_index == 1 and header.params_version == 1
        assert columns["version"].tolist() == [1, 1] and columns["obs"].shape == (2, 8, 4)
        message.ack()
        seen += 1
    consumer.close()
    assert seen == 3
    client.close()


def test_a_full_queue_holds_the_actions_back_and_nothing_is_dropped(serve_task: Any) -> None:
    """Backpressure: with the queue at its capacity the server stops answering once the little it holds
    (two messages waiting for the sender, one being sent) is full, so the actor waits; once the trainer
    drains the queue, acting goes on, and every segment arrives."""
    served = serve_task(_impala(), actor_num=1, capacity=2)
    client = served.client(0)
    done = threading.Event()

    def act() -> None:
        _step(client, _obs(served), 8 * 10 + 1)  # ten segments of each of 2 envs: ten messages
        done.set()

    thread = threading.Thread(target=act, daemon=True)
    thread.start()
    consumer = open_queue(None, namespace=served.board.task_name, role="consumer", redis_params=served.redis_params)
    wait_for(lambda: consumer.depth() == 2, 10, "the queue to fill")
    assert not done.wait(1.0)  # held back (a second is many round trips)
    assert served.run.rows.backpressure_wait_s > 0 or served.run.rows.stalled_since is not None
    received = 0
    while received < 10:
        message = consumer.get(timeout=10)
        assert message is not None, f"only {received} of 10 segments came"
        message.ack()
        received += 1
    assert done.wait(10)
    consumer.close()
    client.close()


def test_dqn_explores_with_each_slots_epsilon_on_the_server(serve_task: Any) -> None:
    config = dqn.Config(envs_per_actor=2, seed=0)
    served = serve_task(config, actor_num=3)
    for slot in range(3):
        worker = served.run._make_worker(slot)
        assert isinstance(worker, dqn.DQNWorker)
        np.testing.assert_allclose(worker.epsilon, config.actor_epsilon(slot, 3))
    every = np.concatenate([served.run._make_worker(s).epsilon for s in range(3)])
    assert len(set(every.tolist())) == 6  # not one ε for all: Ape-X's schedule over the 3 slots' 2 envs each


def test_a_lone_slot_anneals_epsilon_over_the_tasks_plan_on_the_server(serve_task: Any) -> None:
    """One actor stepping one env: the server plans its ε from the task's limits (10**9 env steps, so ε is
    still at epsilon_start for its first step)."""
    served = serve_task(dqn.Config(seed=0, envs_per_actor=1, epsilon_start=0.9, epsilon_decay=0.5), actor_num=1)
    worker = served.run._make_worker(0)
    assert isinstance(worker, dqn.DQNWorker)
    worker.act(np.zeros((1, 4), np.float32))
    np.testing.assert_allclose(worker.epsilon, [0.9])


def _raw_request(served: Served, slot: int, uid: str, columns: dict[str, np.ndarray] | bytes, secret: str | None,
                 seq: int = 0) -> Refusal | bytes:
    """One request sent by hand (what a forger could send: columns, or any bytes); the server's answer."""
    served.board.claim_lease(f"actor:{slot}", uid, 60_000)
    if isinstance(columns, bytes):
        blob = columns
    else:
        codec = Codec(secret=secret, task=served.board.task_name, max_bytes=2**26)
        header = BatchHeader(actor_id=f"{uid}.0", actor_index=slot, epoch=0, seq=seq, params_version=0,
                             count=len(columns["obs"]), created_at=time.time(), task=task_tag(served.board.task_id))
        blob = codec.encode_batch(header, columns, None)
    host, _, port = served.run.address.rpartition(":")
    link = ClientLink(host, int(port), False, None, 2**26)
    try:
        return link.round_trip(blob, lambda: None, lambda: True, 60.0)
    except Refusal as e:
        return e
    finally:
        link.close()


def _refusal(answer: Refusal | bytes) -> Status:
    assert isinstance(answer, Refusal), f"the server answered a bad request with actions ({len(answer)} bytes)"
    return answer.status


def _good_request(served: Served) -> dict[str, np.ndarray]:
    obs = _obs(served)
    n = len(obs)
    return {"obs": obs, "final_obs": obs, "reward": np.zeros(n, np.float32), "terminated": np.zeros(n, bool),
            "truncated": np.zeros(n, bool), "started": np.ones(n, bool)}


@pytest.mark.parametrize("forgery", ["nan_reward", "obs_out_of_bounds", "obs_shape", "obs_dtype", "started_mid_episode",
                                     "extra_env", "garbage"])
def test_a_forged_request_is_refused_and_counted_and_the_server_goes_on(serve_task: Any, forgery: str) -> None:
    served = serve_task(_impala(), actor_num=2)
    good = served.client(0)
    _step(good, _obs(served), 2)
    columns = _good_request(served)
    forged: dict[str, np.ndarray] | bytes = columns
    if forgery == "nan_reward":
        columns["reward"][0] = np.nan
    elif forgery == "obs_out_of_bounds":
        columns["obs"] = columns["obs"] + 1e12  # past the env's declared bounds
    elif forgery == "obs_shape":
        columns["obs"] = np.zeros((2, 5), np.float32)
        columns["final_obs"] = columns["obs"]
    elif forgery == "obs_dtype":
        columns["obs"] = columns["obs"].astype(np.float64)
    elif forgery == "started_mid_episode":
        columns["started"][1] = False  # a stream's first request must start every episode
    elif forgery == "extra_env":
        forged = {k: np.concatenate([v, v[:1]]) for k, v in columns.items()}
    elif forgery == "garbage":
        forged = b"SRL\x00" + bytes(range(256)) * 4
    answer = _raw_request(served, 1, "forger", forged, None)
    assert _refusal(answer) == Status.INVALID_ARGUMENT
    assert served.run.refused == 1
    assert len(_step(good, _obs(served), 2)) == 2  # the other actor is still served
    good.close()


def test_a_huge_request_is_cut_off_before_it_is_read(serve_task: Any) -> None:
    """A frame declared longer than the task's largest request is refused from its head alone (its bytes are
    never read, so a forger cannot make the server hold them); counted; the server goes on."""
    import struct

    served = serve_task(_impala(), actor_num=2)
    host, _, port = served.run.address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(HELLO + struct.pack("<IB", 2**30, 1))  # a head announcing a gigabyte, and nothing else
        data = b""
        while len(data) < 6:
            chunk = sock.recv(4096)
            assert chunk, "the server closed the connection without saying why"
            data += chunk
        _, kind, status = struct.unpack_from("<IBB", data)
        assert kind == 2 and Status(status) == Status.RESOURCE_EXHAUSTED
    wait_for(lambda: served.run.refused == 1, 10, "the refusal to be counted")
    good = served.client(0)
    assert len(_step(good, _obs(served), 2)) == 2
    good.close()


def test_a_client_of_another_protocol_is_told_so(serve_task: Any) -> None:
    """A peer that does not open with srl's hello (an older node speaking gRPC, a port scanner) is refused
    with what this server speaks; the server goes on."""

    served = serve_task(_impala(), actor_num=1)
    host, _, port = served.run.address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        data = b""
        while chunk := sock.recv(4096):
            data += chunk
    assert data[4] == 2 and Status(data[5]) == Status.INVALID_ARGUMENT
    assert b"gRPC" in data and b"same version on every node" in data
    good = served.client(0)
    assert len(_step(good, _obs(served), 2)) == 2
    good.close()


def test_an_actor_without_the_secret_is_refused(serve_task: Any) -> None:
    served = serve_task(_impala(), actor_num=2, secret="the-task-secret")
    answer = _raw_request(served, 0, "stranger", _good_request(served), None)
    assert _refusal(answer) == Status.UNAUTHENTICATED
    wrong = served.client(1, secret="another-secret")
    with pytest.raises(InferenceRefusedError, match="refused"):
        wrong.act(_obs(served))
    assert served.run.refused == 2
    right = served.client(1)
    assert right.act(_obs(served)).shape == (2,)
    right.close()


def test_over_tls_the_actor_checks_the_servers_certificate(serve_task: Any, tmp_path: Any) -> None:
    from tests.tls_fixtures import make_tls_files

    tls = make_tls_files(tmp_path)
    served = serve_task(_impala(), actor_num=2, tls_cert_file=str(tls.cert), tls_key_file=str(tls.key))
    address = served.board.get_inference_address()
    assert address is not None and address.tls and address.address.startswith("127.0.0.1:")
    trusted = served.client(0)
    trusted.ca_file = str(tls.ca)
    assert trusted.act(_obs(served)).shape == (2,)
    trusted.close()
    fooled = served.client(1)
    fooled.ca_file = str(tls.wrong_ca)  # a server it cannot verify: never one it acts through
    with pytest.raises(InferenceLostError, match="UNAVAILABLE"):
        fooled.act(_obs(served))
    assert served.run.agent_steps == 2


def test_a_board_over_tls_demands_a_server_over_tls(redis_url: str, namespace: str) -> None:
    runner = srl.Runner("CartPole-v1", _impala())
    config_json = json.dumps({**runner.task_config(), "actor_num": 1, "max_steps": 100, "inference": "central"})
    task = build_task(config_json)
    board = Board(RedisParameters(url=redis_url, task_name=namespace).connect(), namespace)
    with pytest.raises(ValueError, match="tls_cert_file"):
        InferenceRun(board, RedisParameters(url="rediss://127.0.0.1:1/0", task_name=namespace), None, task,
                     InferenceOptions(uid="inference-test"))


def test_an_actor_that_does_not_hold_its_slot_is_refused(serve_task: Any) -> None:
    served = serve_task(_impala(), actor_num=2)
    served.board.claim_lease("actor:0", "the-real-actor", 60_000)
    answer = _raw_request(served, 0, "an-impostor", _good_request(served), None)
    assert _refusal(answer) == Status.PERMISSION_DENIED  # the lease check, not the claim in _raw_request, decides
    assert served.run.refused == 1


def test_an_actor_whose_lease_lapses_is_dropped_and_its_state_freed(serve_task: Any) -> None:
    served = serve_task(_impala(recurrent="lstm"), actor_num=2)
    client = served.client(0)
    _step(client, _obs(served), 3)
    assert set(served.run._sessions) == {0}
    served.board.release_lease("actor:0", "actor-test-0")  # as a lease that lapsed (the actor killed, paused)
    wait_for(lambda: not served.run._sessions, 10, "the server to free the actor's state")
    with pytest.raises(InferenceLostError):
        _step(client, _obs(served), 1)
    client.close()


def test_several_servers_share_the_slots_and_a_missing_ones_actors_go_to_another_and_back(
    serve_task: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two servers of one task: slot 0 acts through server 0 and slot 1 through server 1; when server 1 goes,
    slot 1's actor restarts its episodes on server 0, and once a new server 1 serves it goes back."""
    from srl.runner.distribution.actor import inference_client

    monkeypatch.setattr(inference_client, "RETURN_S", 0.2)
    first = serve_task(_impala(), actor_num=2, servers=2)
    second = serve_task(_impala(), actor_num=2, servers=2, server=1)
    wait_for(lambda: second.run.parameter.version == 1, 10, "server 1 to load the params")
    addresses = first.board.get_inference_addresses(2)
    assert [a.server if a else None for a in addresses] == [0, 1]
    assert addresses[0] is not None and addresses[0].address == first.run.address
    zero, one = first.client(0), first.client(1)
    obs = _obs(first)
    _step(zero, obs, 3)
    _step(one, obs, 3)
    assert first.run.agent_steps == 3 * 2 and second.run.agent_steps == 3 * 2
    assert set(first.run._sessions) == {0} and set(second.run._sessions) == {1}

    second.run.stop.set("test: server 1 goes")
    second.thread.join(timeout=10)
    wait_for(lambda: first.board.lease_holder("inference:1")[0] is None, 10, "server 1's lease to be released")
    with pytest.raises(InferenceLostError):  # its connection ended with it: the episodes start again
        _step(one, obs, 1)
    _step(one, obs, 3)
    assert set(first.run._sessions) == {0, 1}  # slot 1 acts through server 0 now
    assert one.connected_to == first.run.address

    third = serve_task(_impala(), actor_num=2, servers=2, server=1)  # a new server 1
    wait_for(lambda: third.run.parameter.version == 1, 10, "the new server 1 to load the params")
    time.sleep(0.25)  # past RETURN_S: the next act looks for its own server
    with pytest.raises(InferenceLostError, match="going back"):
        one.act(obs)
    _step(one, obs, 2)
    assert one.connected_to == third.run.address and set(third.run._sessions) == {1}
    wait_for(lambda: set(first.run._sessions) == {0}, 10, "server 0 to free slot 1's state")
    zero.close()
    one.close()


def test_a_task_of_several_servers_shows_each_on_the_progress_line_and_the_board_view(serve_task: Any) -> None:
    from srl.runner.distribution.client.report import progress_lines

    first = serve_task(_impala(), actor_num=2, servers=3)
    serve_task(_impala(), actor_num=2, servers=3, server=2)
    board = first.board
    status = board.get_status()
    assert status is not None and status.inference_servers == 3
    view = board.view(status.actor_num, servers=status.inference_servers)
    assert {k: v for k, v in view.holders.items() if k.startswith("inference")} == {
        "inference": "inference-test", "inference:1": None, "inference:2": "inference-test-1"}
    wait_for(lambda: "inference:2" in board.get_all_stats(), 10, "server 2's heartbeat")
    lines = [x for x in progress_lines(board, status, 1.0) if x.startswith("  inference")]
    assert len(lines) == 3
    assert lines[0].startswith("  inference inference-test at ") and "MISSING" in lines[1]
    assert lines[2].startswith("  inference:2 inference-test-1 at ")


def test_an_actor_of_two_halves_steps_one_while_the_others_request_is_on_its_way(serve_task: Any) -> None:
    """Double buffering: an actor's 4 envs in two halves, each its own session of 2 envs on the server (Ape-X's
    ε of those very envs); a half's next request goes as its step ends, so by the time the other half has
    stepped, its actions are in; the halves' episodes are the actor's."""
    from srl.base.rollout import Rollout
    from srl.runner.distribution.actor.halves import Halves

    config = dqn.Config(envs_per_actor=4, seed=0, batch_size=32, warmup_size=200)
    served = serve_task(config, actor_num=2, double_buffer=True)
    assert served.task.halves == 2 and served.run.streams.envs == 2
    epsilon = np.concatenate([served.run._make_worker(key).epsilon for key in range(4)])  # type: ignore[attr-defined]
    np.testing.assert_allclose(epsilon, np.concatenate([config.actor_epsilon(s, 2) for s in range(2)]))

    served.board.claim_lease("actor:1", "actor-halves", 60_000)
    clients = [InferenceClient(served.board, served.run.spec, 2, 1, "actor-halves.0", task_tag(served.board.task_id),
                               Codec(task=served.board.task_name), StopFlag(), half=half, halves=2) for half in (0, 1)]
    halves = Halves([Rollout(served.task.env_config, c, 2, seed=h * 2) for h, c in enumerate(clients)], clients)
    assert halves.num_envs == 4 and halves.envs_per_step == 2
    episodes = []
    for _ in range(200):
        episodes += halves.step()
    assert set(served.run._sessions) == {2, 3}  # slot 1's two halves
    assert {s.slot for s in served.run._sessions.values()} == {1}
    assert 200 * 2 <= served.run.agent_steps <= 200 * 2 + 2 * 2  # and the requests sent ahead, if answered yet
    assert episodes and {e.env_index for e in episodes} <= {0, 1, 2, 3} and max(e.env_index for e in episodes) >= 2
    assert all(c._sent is not None for c in clients)  # each half's next request is out already
    halves.close()


def test_double_buffer_halves_an_even_number_of_envs_with_central_inference() -> None:
    with pytest.raises(ValueError, match="give inference='central' too"):
        srl.Runner("CartPole-v1", _impala()).train_distribution(RedisParameters(), max_steps=100, double_buffer=True)
    with pytest.raises(ValueError, match="envs_per_actor must be even, found 3"):
        srl.Runner("CartPole-v1", impala.Config(envs_per_actor=3)).train_distribution(
            RedisParameters(), max_steps=100, inference="central", double_buffer=True)


def test_inference_servers_need_central_inference_and_a_count_a_task_may_have() -> None:
    runner = srl.Runner("CartPole-v1", _impala())
    with pytest.raises(ValueError, match="give inference='central' too"):
        runner.train_distribution(RedisParameters(), actor_num=2, max_steps=100, inference_servers=2)
    with pytest.raises(ValueError, match=r"inference_servers must be an integer in 1\.\.64, got 65"):
        runner.train_distribution(RedisParameters(), actor_num=2, max_steps=100, inference="central",
                                  inference_servers=65)


# ------------------------------------------------------------------------------------ real processes


@pytest.mark.parametrize(("config", "double_buffer"), [
    (_impala(), False), (dqn.Config(envs_per_actor=2, batch_size=32, warmup_size=200, seed=0), False),
    (_impala(envs_per_actor=4), True),
], ids=["impala", "apex-dqn", "impala-double-buffered"])
def test_a_central_inference_run_trains_and_ends_with_an_evaluation(config: RLConfig, double_buffer: bool,
                                                                     redis_url: str, namespace: str) -> None:
    runner = srl.Runner("CartPole-v1", config)
    runner.train_distribution(RedisParameters(url=redis_url, task_name=namespace), actor_num=2, max_train_count=60,
                              progress_interval=None, local_processes=True, inference="central",
                              double_buffer=double_buffer, actor_options={"batch_size": 64, "batch_max_age": 0.2},
                              inference_options={"batch_size": 64, "batch_max_age": 0.2})
    board = board_for(redis_url, namespace)
    status = board.get_status()
    assert status is not None and status.status == TaskState.END
    counters = board.get_counters()
    assert counters.get("bad_messages", 0) == 0 and counters["received_transitions"] > 0
    assert counters["sent_batches"] >= counters["received_batches"] > 0
    stats = board.get_all_stats()
    assert stats["inference"]["agent_steps"] > 0 and stats["inference"]["refused_requests"] == 0
    assert all(stats[f"actor:{i}"]["sent_batches"] == 0 for i in range(2))  # actors send no rows
    assert all(stats[f"actor:{i}"]["params_fetched_bytes"] == 0 for i in range(2))  # nor fetch params
    assert len(runner.evaluate(max_episodes=2)) == 2
    board.delete_task()


def test_sync_ppo_is_refused_with_central_inference() -> None:
    runner = srl.Runner("CartPole-v1", ppo.Config())
    with pytest.raises(ValueError, match="lockstep"):
        runner.train_distribution(RedisParameters(), actor_num=1, max_steps=100, inference="central")


INFERENCE_ARGS = ("--listen", "127.0.0.1:0", "--batch-max-age", "0.2")


def _central_run(nodes: list[Any], redis_url: str, namespace: str, tmp_path: Any, actors: int,
                 config: RLConfig, max_train_count: int = 150) -> tuple[Any, Board, ClientThread]:
    """A trainer, a server and ``actors`` actor processes (2 slots: the rest stand by) and a client that
    trains ``max_train_count`` steps with central inference, once the server acts; the server's node, the
    board, the client."""
    start(nodes, "trainer", redis_url, namespace, tmp_path)
    server = start(nodes, "inference", redis_url, namespace, tmp_path, *INFERENCE_ARGS)
    for _ in range(actors):
        start(nodes, "actor", redis_url, namespace, tmp_path)
    board = board_for(redis_url, namespace)
    client = ClientThread(srl.Runner("CartPole-v1", config), RedisParameters(url=redis_url, task_name=namespace),
                          actor_num=2, max_train_count=max_train_count, local_processes=False, inference="central")
    client.start()
    # the budget covers five processes starting (each imports torch): minutes on a loaded 2-core machine
    wait_for(lambda: board.get_all_stats().get("inference", {}).get("agent_steps", 0) > 200, 300,
             "the server to act for the actors")
    return server, board, client


def test_a_standby_server_takes_over_when_the_server_is_killed(redis_url: str, namespace: str,
                                                              nodes: list[Any], tmp_path: Any) -> None:
    """SIGKILL the server mid-run: the standby takes the lease, actors reconnect and restart their
    episodes, the run finishes, and nothing queued is lost (sent = received at the end)."""
    first, board, client = _central_run(nodes, redis_url, namespace, tmp_path, 2, _impala())
    for slot in range(2):  # each actor's acting thread yields the CPU to the server; its board threads keep theirs
        actor = lease_holder_pid(board, f"actor:{slot}")
        assert actor is not None
        nices = thread_nices(actor)
        assert nices[actor] == ActorOptions().central_nice and min(nices.values()) == 0, nices
    pid = lease_holder_pid(board, "inference")
    assert pid == first.proc.pid
    start(nodes, "inference", redis_url, namespace, tmp_path, *INFERENCE_ARGS)  # the standby
    sigkill(pid)
    wait_for(lambda: (lease_holder_pid(board, "inference") or pid) != pid, 30, "the standby to take the lease")
    client.join(timeout=120)
    assert not client.is_alive() and client.error is None, client.error
    status = board.get_status()
    assert status is not None and status.status == TaskState.END
    actors = [n for n in nodes if n.role == "actor"]
    assert any("restarting this actor's episodes" in n.output() for n in actors)
    counters = board.get_counters()
    assert counters.get("bad_messages", 0) == 0 and counters["received_batches"] > 0


def test_a_server_of_two_killed_mid_run_leaves_its_actors_to_the_other_and_the_run_finishes(
    redis_url: str, namespace: str, nodes: list[Any], tmp_path: Any
) -> None:
    """Two servers share the actor slots, no standby: SIGKILL one mid-run; its actors restart their episodes
    on the other, the run ends, and the rows of both servers were trained on (nothing refused)."""
    start(nodes, "trainer", redis_url, namespace, tmp_path)
    for _ in range(2):
        start(nodes, "inference", redis_url, namespace, tmp_path, *INFERENCE_ARGS)
    for _ in range(2):
        start(nodes, "actor", redis_url, namespace, tmp_path)
    board = board_for(redis_url, namespace)
    client = ClientThread(srl.Runner("CartPole-v1", _impala()), RedisParameters(url=redis_url, task_name=namespace),
                          actor_num=2, max_train_count=10_000_000, local_processes=False, inference="central",
                          inference_servers=2)
    client.start()
    # each slot on its own server (one that came before its server was up goes back to it): one session each
    wait_for(lambda: all(board.get_all_stats().get(name, {}).get("agent_steps", 0) > 100
                         and board.get_all_stats()[name].get("sessions") == 1 for name in ("inference", "inference:1")),
             300, "both servers to act for their own actor")
    victim = lease_holder_pid(board, "inference:1")
    assert victim is not None
    survivor = next(n for n in nodes if n.role == "inference" and n.proc.pid != victim)
    before = survivor.output().count("connected for slot 1")  # 1 if slot 1 came before server 1 did, else 0
    sigkill(victim)
    wait_for(lambda: survivor.output().count("connected for slot 1") > before, 60,
             "slot 1 to come to the other server")
    steps = board.get_all_stats()["inference"]["agent_steps"]
    wait_for(lambda: board.get_all_stats()["inference"]["sessions"] == 2
             and board.get_all_stats()["inference"]["agent_steps"] > steps + 200, 60, "it to act for both slots")
    assert board.end_task(TaskState.END, "server 0 serves both slots: test over")
    client.join(timeout=120)
    assert not client.is_alive() and client.error is None, client.error
    counters = board.get_counters()
    assert counters.get("bad_messages", 0) == 0 and counters["received_batches"] > 0
    assert any("restarting this actor's episodes" in n.output() for n in nodes if n.role == "actor")


def test_batched_sampling_draws_each_action_with_its_probability() -> None:
    """The draw acting uses (a few batched ops for every env, and for a server's every worker): the
    Gumbel-max of the logits follows the policy's probabilities, a Gaussian's sample is mean + std x
    noise, and the log-probabilities are the distributions' own."""
    from torch.distributions import Categorical, Normal

    from srl.rl.actor_critic import sample_actions

    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1, 0.5, 0.5]])).repeat(20_000, 1)  # two splits: 3 and 2
    noise = torch.rand((20_000, 5), generator=torch.Generator().manual_seed(0))
    action, logprob = sample_actions(logits, noise, [3, 2])
    assert action.shape == (20_000, 2)
    frequencies = torch.bincount(action[:, 0], minlength=3).float() / 20_000
    assert torch.allclose(frequencies, torch.tensor([0.7, 0.2, 0.1]), atol=0.015)
    expected = Categorical(logits=logits[:, :3]).log_prob(action[:, 0]) + Categorical(
        logits=logits[:, 3:]).log_prob(action[:, 1])
    assert torch.allclose(logprob, expected, atol=1e-6)
    greedy, _ = sample_actions(logits, None, [3, 2])
    assert (greedy[:, 0] == 0).all()
    mean, logstd = torch.zeros(5, 2), torch.full((1, 2), math.log(2.0))
    draws = torch.randn((5, 2), generator=torch.Generator().manual_seed(1))
    action, logprob = sample_actions(mean, draws, [2], logstd)
    normal = Normal(mean, torch.full((5, 2), 2.0))
    assert torch.allclose(action, 2.0 * draws, atol=1e-6)
    assert torch.allclose(logprob, normal.log_prob(action).sum(-1), atol=1e-5)


def test_progress_and_the_dashboard_show_the_server_or_how_to_start_one(serve_task: Any, redis_url: str) -> None:
    from srl.runner.distribution.client.report import NodeHints, progress_lines

    served = serve_task(_impala(), actor_num=1)
    client = served.client(0)
    _step(client, _obs(served), 3)
    board = served.board
    wait_for(lambda: board.get_all_stats().get("inference", {}).get("sessions") == 1, 10, "a heartbeat")
    status = board.get_status()
    assert status is not None
    line = next(x for x in progress_lines(board, status, 1.0) if x.startswith("  inference"))
    assert f"inference inference-test at {served.run.address}" in line and "1 actor(s) connected" in line
    from srl.dashboard import Dashboard

    detail = Dashboard(served.redis_params.connect(), "test").task(board.task_name)
    assert detail is not None and detail["inference"]["holder"] == "inference-test"
    assert detail["inference"]["stats"]["sessions"] == 1
    client.close()
    served.run.stop.set("test: the server goes")
    served.thread.join(timeout=10)
    wait_for(lambda: board.lease_holder("inference")[0] is None, 10, "the lease to be released")
    hints = NodeHints.of(RedisParameters(url=redis_url, task_name=board.task_name))
    line = next(x for x in progress_lines(board, status, 1.0, hints=hints) if x.startswith("  inference"))
    assert "MISSING" in line and f"srl inference --url {redis_url}" in line


def test_an_actor_killed_mid_episode_is_replaced_and_the_run_finishes(redis_url: str, namespace: str,
                                                                       nodes: list[Any], tmp_path: Any) -> None:
    """SIGKILL an actor: its stream closes with the process and the server frees its state; the standby
    actor takes the slot and connects; the run ends. The budget is out of reach (the other actor alone
    could end a short run before the dead one's lease lapses); the test ends the run once the standby acts."""
    server, board, client = _central_run(nodes, redis_url, namespace, tmp_path, 3, _impala(recurrent="lstm"),
                                         max_train_count=10_000_000)
    victim = lease_holder_pid(board, "actor:0")
    assert victim is not None
    sigkill(victim)
    wait_for(lambda: (lease_holder_pid(board, "actor:0") or victim) != victim, 60, "the standby to take slot 0")
    wait_for(lambda: server.output().count("connected for slot 0") >= 2, 60, "the standby to connect for slot 0")
    assert board.end_task(TaskState.END, "the standby serves slot 0: test over")
    client.join(timeout=120)
    assert not client.is_alive() and client.error is None, client.error
    status = board.get_status()
    assert status is not None and status.status == TaskState.END
    log = server.output()
    assert "left slot 0; its state is freed" in log  # the killed actor's state went with its stream
    assert log.count("connected for slot 0") >= 2  # and the standby connected in its place


@contextlib.contextmanager
def _silent_server(board: Board, uid: str) -> Iterator[None]:
    """A server that holds the inference lease as ``uid`` and says where it listens, takes connections and never
    answers (stuck, paused, or cut off with its connections open)."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(listener.accept()[0]), daemon=True).start()
    try:
        assert board.claim_lease("inference", uid, 60_000)
        assert board.set_inference_address(uid, f"127.0.0.1:{listener.getsockname()[1]}", False)
        yield
    finally:
        listener.close()
        for sock in accepted:
            sock.close()


def _acting(board: Board, stop: StopFlag) -> tuple[InferenceClient, threading.Thread, list[BaseException]]:
    """An actor's client of 2 CartPole envs acting once in a thread of its own; what its act raised."""
    client = InferenceClient(board, env_spec(EnvConfig("CartPole-v1")), 2, 0, "actor-x.0", task_tag(""),
                             Codec(task=board.task_name), stop)
    raised: list[BaseException] = []

    def act() -> None:
        try:
            client.act(np.zeros((2, 4), np.float32))
        except BaseException as e:
            raised.append(e)

    thread = threading.Thread(target=act, daemon=True)
    thread.start()
    return client, thread, raised


def test_an_actor_waiting_for_a_reply_stops_at_once_when_its_run_stops(board: Board) -> None:
    """A server that never answers (stuck, or not yet given params) cannot hold an actor past its task's
    end: stopping the run ends the wait at once."""
    with _silent_server(board, "stuck-server"):
        stop = StopFlag()
        client, thread, raised = _acting(board, stop)
        thread.join(0.3)
        assert thread.is_alive()  # waiting for the reply that does not come
        stop.set("the task ended")
        thread.join(5.0)
        assert not thread.is_alive(), "the actor still waits for its reply after its run stopped"
        assert len(raised) == 1 and isinstance(raised[0], InferenceLostError) and "stopping" in str(raised[0])
        client.close()


def test_an_actor_whose_server_went_silent_and_lost_its_lease_goes_to_the_one_named_now(
    board: Board, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that stops answering (paused, its host gone: the connection stays open) is waited for while
    it holds the inference lease (a full queue holds replies back); once another holds it, the actor's wait
    ends, and its next act connects to the server the board names then."""
    from srl.runner.distribution.actor import inference_client

    monkeypatch.setattr(inference_client, "SILENCE_CHECK_S", 0.2)
    with _silent_server(board, "paused-server"):
        client, thread, raised = _acting(board, StopFlag())
        thread.join(1.5)
        assert thread.is_alive()  # silent, but it holds the lease: the actor waits
        board.release_lease("inference", "paused-server")  # its lease lapsed; a standby takes it
        assert board.claim_lease("inference", "standby-server", 60_000)
        thread.join(10.0)
        assert not thread.is_alive(), "the actor still waits on a server that lost its lease"
        assert len(raised) == 1 and isinstance(raised[0], InferenceLostError) and "silent" in str(raised[0])
        client.close()


def test_a_request_the_server_does_not_read_waits_as_long_as_the_server_holds_its_lease() -> None:
    """A server whose queue is full reads no request (backpressure): the actor's send waits, past any socket
    timeout, until the run stops or the server no longer holds its lease."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(listener.accept()[0]), daemon=True).start()
    try:
        link = ClientLink("127.0.0.1", listener.getsockname()[1], False, None, 2**26)
        serving = threading.Event()
        serving.set()
        raised: list[BaseException] = []

        def send() -> None:
            try:
                link.send(bytes(2**25), lambda: None, serving.is_set, 0.2)  # far more than the socket buffers
            except BaseException as e:
                raised.append(e)

        thread = threading.Thread(target=send, daemon=True)
        thread.start()
        thread.join(1.5)
        assert thread.is_alive() and not raised  # still waiting: the server holds its lease
        serving.clear()
        thread.join(5.0)
        assert not thread.is_alive() and len(raised) == 1 and isinstance(raised[0], TimeoutError)
        link.close()
    finally:
        listener.close()
        for sock in accepted:
            sock.close()


def test_a_failure_serving_one_connection_ends_that_connection_not_the_server(serve_task: Any) -> None:
    served = serve_task(_impala(), actor_num=2)
    good = served.client(0)
    _step(good, _obs(served), 2)
    make_worker = served.run.streams.make_worker

    def failing(key: int, session: int) -> Worker:
        if key == 1:
            raise RuntimeError("a worker this server cannot build")
        return make_worker(key, session)

    served.run.streams.make_worker = failing
    unlucky = served.client(1)
    with pytest.raises(InferenceLostError, match=r"UNAVAILABLE.*the server failed serving this actor"):
        unlucky.act(_obs(served))
    assert served.thread.is_alive() and len(_step(good, _obs(served), 2)) == 2
    assert served.run.refused == 0  # the server's fault, not a bad request
    good.close()
    unlucky.close()


def test_a_lost_life_ends_the_workers_episode_without_a_new_one(serve_task: Any) -> None:
    """Atari's training signal: a lost life is a terminal step for the worker while the game goes on (no
    reset), as Rollout tells a local worker; the server acts on."""
    served = serve_task(_impala(), actor_num=1)
    client = served.client(0)
    obs = _obs(served)
    client.act(obs)
    client.observe(np.ones(2, np.float32), obs, np.array([True, False]), np.zeros(2, bool))  # no reset follows
    assert client.act(obs).shape == (2,)
    session = served.run._sessions[0]
    assert session.worker._done[0].tolist() == [True, False]  # type: ignore[attr-defined]
    assert served.run.refused == 0
    client.close()


def test_stacks_that_do_not_slide_are_refused_and_the_server_goes_on(serve_task: Any) -> None:
    """Frames sent once need stacks that slide: a request whose stacks do not is refused and counted
    (the worker's check raises), not the end of the server."""
    served = serve_task(impala.Config(envs_per_actor=1, segment_length=4, seed=0), env="ALE/Pong-v5", actor_num=2)
    spec = served.run.spec
    frame = np.full((1, 1, *spec.obs_shape[1:]), 7, np.uint8)
    obs = np.repeat(frame, spec.obs_shape[0], axis=1)  # an episode's first stack: one frame, repeated
    forger = served.client(1)
    forger.act(obs)
    forger.observe(np.zeros(1, np.float32), obs, np.zeros(1, bool), np.zeros(1, bool))
    unrelated = np.random.default_rng(0).integers(0, 255, size=obs.shape, dtype=np.uint8)
    with pytest.raises(InferenceRefusedError, match="slide"):
        forger.act(unrelated)
    assert served.run.refused == 1
    honest = served.client(0)
    assert honest.act(obs).shape == (1,)
    honest.close()


def test_a_newer_stream_for_a_slot_replaces_the_older_one(serve_task: Any) -> None:
    served = serve_task(_impala(), actor_num=1)
    old = served.client(0, uid="actor-old")
    _step(old, _obs(served), 2)
    new = served.client(0, uid="actor-new")  # the slot's lease went to another actor (the old one paused)
    served.board.release_lease("actor:0", "actor-old")
    served.board.claim_lease("actor:0", "actor-new", 60_000)
    _step(new, _obs(served), 2)
    assert served.run._sessions[0].uid == "actor-new"
    with pytest.raises(InferenceLostError):  # the old stream was ended, not left holding a thread
        _step(old, _obs(served), 1)
    wait_for(lambda: not served.run._retired, 5, "the replaced session to be dropped")
    new.close()


def test_a_failing_forward_pass_fails_its_batch_not_the_server(serve_task: Any) -> None:
    served = serve_task(_impala(), actor_num=1)
    client = served.client(0)
    _step(client, _obs(served), 2)
    net = served.run.parameter.net  # type: ignore[attr-defined]
    working = net.action_outputs

    def out_of_memory(x: torch.Tensor) -> Any:
        net.action_outputs = working  # once
        raise RuntimeError("CUDA out of memory (as a device would say)")

    net.action_outputs = out_of_memory
    with pytest.raises(InferenceLostError, match="UNAVAILABLE"):
        client.act(_obs(served))
    assert len(_step(client, _obs(served), 2)) == 2  # reconnected, acting again
    assert served.run.refused == 0 and served.thread.is_alive()
    client.close()


def test_a_learner_bound_asynchronous_central_run_refuses_no_row_as_stale(
    redis_url: str, namespace: str, nodes: list[Any], tmp_path: Any
) -> None:
    """The server makes a central actor's segments, so the actor counts them from its envs' steps (one per
    ``segment_length`` steps of each env) and paces itself on the lag budget as a local actor does: a learner
    much slower than its actor (100 epochs an update) trains every row within ``max_policy_lag`` instead of
    refusing those that aged in the queue."""
    from srl.runner.distribution.node.stats import Reports

    config = ppo.Config(seed=0, envs_per_actor=4, segment_length=32, epochs=100, sync=False, max_policy_lag=6)
    start(nodes, "trainer", redis_url, namespace, tmp_path)
    start(nodes, "inference", redis_url, namespace, tmp_path, *INFERENCE_ARGS)
    actor = start(nodes, "actor", redis_url, namespace, tmp_path)
    client = ClientThread(srl.Runner("CartPole-v1", config), RedisParameters(url=redis_url, task_name=namespace),
                          actor_num=1, max_steps=12_000, local_processes=False, inference="central")
    client.start()
    board = board_for(redis_url, namespace)
    client.join(300)
    assert not client.is_alive(), f"the run did not end: {board.get_status()}, {board.get_all_stats()}"
    assert client.error is None, client.error
    counters, reports = board.get_counters(), Reports.read(board)
    assert reports.trainer is not None and reports.trainer.lag_max is not None
    assert counters.get("stale_rows", 0) == 0, (counters, reports.trainer, actor.output()[-3000:])
    assert reports.trainer.lag_max <= 6
    assert reports.actors[0].rate_limited_s > 0, reports.actors[0]  # it waited for the learner


def test_bench_inference_times_the_servers_act_path_by_workers_and_envs() -> None:
    """``bench/inference.py --only batching`` runs in one command, without Redis, a row per workers x envs."""
    bench = Path(__file__).resolve().parents[1] / "bench" / "inference.py"
    done = subprocess.run([sys.executable, str(bench), "--only", "batching", "--envs", "MinAtar/Breakout-v1",
                           "--actors", "2", "--envs-per-actor", "4", "--act-seconds", "0.1"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith("MinAtar/Breakout-v1")]
    assert [" ".join(row[1:4]) for row in rows] == [f"{w} x {e}" for e in (4, 8, 32) for w in (1, 2)], done.stdout
    assert all(float(row[4]) > 0 for row in rows), done.stdout
    assert [row[5] for row in rows[::2]] == ["1.00"] * 3, done.stdout
