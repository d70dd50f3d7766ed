"""Operating srl: what an operator meets running it for a week (help, typos, bad input, bad
credentials, replaced and re-attached tasks, refusals, counters that reconcile)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import redis

import srl
from srl.cli import build_parser
from srl.runner.distribution import RedisParameters
from srl.runner.distribution.board.board import TaskExistsError, TaskNotFoundError, TaskState
from srl.runner.distribution.client.report import progress_lines
from srl.runner.distribution.settings.credentials import CredentialsError
from tests.conftest import broker_unavailable, port_open, running
from tests.nodes import ClientThread, Node, board_for, start, tiny_config, wait_for
from tests.queue_fixtures import PrivateMosquitto, PrivateRedis

SUBCOMMANDS = sorted(build_parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr]


@pytest.mark.parametrize("command", ["", *SUBCOMMANDS])
def test_every_subcommand_has_help(command: str) -> None:
    args = [sys.executable, "-m", "srl.cli", *([command] if command else []), "--help"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "usage: srl" in done.stdout and "Traceback" not in done.stderr


def test_a_misspelled_setting_raises_with_the_closest_name() -> None:
    from srl.algorithms import dqn, impala, ppo
    from srl.runner.distribution import ActorOptions, RabbitMQParameters, RedisParameters, TrainerOptions

    config = dqn.Config()
    with pytest.raises(AttributeError, match=r"dqn\.Config has no setting 'lr_typo'; did you mean 'lr'"):
        config.lr_typo = 1  # type: ignore[attr-defined]
    with pytest.raises(AttributeError, match="MemoryConfig has no setting 'capcity'; did you mean 'capacity'"):
        config.memory.capcity = 10  # type: ignore[attr-defined]
    with pytest.raises(AttributeError, match="did you mean 'layer_sizes'"):
        config.hidden_block.layer_size = (8,)  # type: ignore[attr-defined]
    for settings in (ppo.Config(), impala.Config(), ActorOptions(), TrainerOptions(), RedisParameters(),
                     RabbitMQParameters()):
        with pytest.raises(AttributeError, match="has no setting 'no_such_thing'"):
            settings.no_such_thing = 1  # type: ignore[attr-defined]
    config.lr, config.memory.capacity = 0.5, 10  # real settings still set
    assert (config.lr, config.memory.capacity) == (0.5, 10)


@pytest.mark.parametrize(("arguments", "error", "says"), [
    ({"max_train_count": 1e3}, TypeError, r"max_train_count must be an integer or None, got 1000\.0 \(a float\)"),
    ({"actor_num": 1.5}, TypeError, r"actor_num must be an integer in 1\.\.100000, got 1\.5 \(a float\)"),
    ({"actor_num": True}, TypeError, r"actor_num must be an integer in 1\.\.100000, got True \(a bool\)"),
    ({"actor_num": 0}, ValueError, r"actor_num must be an integer in 1\.\.100000, got 0"),
    ({"max_steps": "100"}, TypeError, r"max_steps must be an integer or None, got '100' \(a str\)"),
    ({"timeout": -1}, ValueError, r"timeout must be a number > 0 or None, got -1"),
    ({"queue_capacity": 0}, ValueError, r"queue_capacity must be an integer in 1\.\.1000000, got 0"),
    ({"eval_episodes": 0}, ValueError, r"eval_episodes must be an integer in 1\.\."),
    ({"progress_interval": "5"}, TypeError, r"progress_interval must be a number > 0 or None, got '5' \(a str\)"),
    ({"actor_options": {"batch_sise": 8}}, TypeError, r"ActorOptions has no setting 'batch_sise'; did you mean "
                                                      r"'batch_size'"),
    ({"trainer_options": {"checkpoint_dri": "x"}}, TypeError, r"did you mean 'checkpoint_dir'"),
    ({"trainer_options": {"train_ahead": 0.5}}, ValueError, r"trainer_options: train_ahead must be a number >= 1"),
    ({"overwrite": "yes"}, TypeError, r"overwrite must be True or False, got 'yes' \(a str\)"),
    ({"attach": 1}, TypeError, r"attach must be True, False or None, got 1$"),
    ({"log_dir": 5}, TypeError, r"log_dir must be a path \(str or pathlib\.Path\) or None, got 5"),
    ({"trainer_options": {"keep_checkpoints": "3"}}, ValueError, r"trainer_options\.keep_checkpoints: expected an "
                                                                 r"integer, got '3'"),
    ({"actor_options": {"lease_ttl": 0.5, "heartbeat_interval": 1.0}}, ValueError,
     r"actor_options: lease_ttl \(0\.5s\) must be longer than heartbeat_interval"),
    ({"queue_capacity": 8, "rl_lr": "0.001"}, ValueError, r"lr must be a finite number in \(0, 1\], got '0\.001' "
                                                          r"\(a str\)"),
    # one stream (and a server thread) per actor: more actors than a server streams would wait for ever
    ({"inference": "central", "actor_num": 1021, "timeout": 0.5}, ValueError,
     r"central inference serves at most 1020 actors .*, got actor_num=1021; .*envs_per_actor.*inference='local'"),
])
def test_the_client_checks_its_arguments_before_writing_anything(
    redis_url: str, namespace: str, arguments: dict[str, object], error: type[Exception], says: str
) -> None:
    import srl
    from srl.runner.distribution import RedisParameters
    from tests.nodes import board_for, tiny_config

    runner = srl.Runner("Pendulum-v1", tiny_config())
    if "rl_lr" in arguments:  # changed after the Runner checked it
        runner.rl_config.lr = arguments.pop("rl_lr")  # type: ignore[attr-defined]
    kwargs = {"max_train_count": 10, "progress_interval": None, **arguments}
    with pytest.raises(error, match=says):
        runner.train_distribution(RedisParameters(url=redis_url, task_name=namespace), **kwargs)  # type: ignore[arg-type]
    assert board_for(redis_url, namespace).get_status() is None  # nothing was written


def test_every_node_refuses_a_task_of_more_actors_than_central_inference_serves() -> None:
    """A task written by hand (not through the client) with more actors than one inference server streams is
    refused by the nodes that build it, with the same reason the client gives."""
    import json

    from srl.runner.distribution.settings.task import MAX_CENTRAL_ACTORS, TaskConfigError, build_task
    from tests.nodes import tiny_config

    config = {**srl.Runner("Pendulum-v1", tiny_config()).task_config(), "inference": "central"}
    assert build_task(json.dumps({**config, "actor_num": MAX_CENTRAL_ACTORS})).actor_num == MAX_CENTRAL_ACTORS
    with pytest.raises(TaskConfigError, match=rf"at most {MAX_CENTRAL_ACTORS} actors .*got actor_num="):
        build_task(json.dumps({**config, "actor_num": MAX_CENTRAL_ACTORS + 1}))
    assert build_task(json.dumps({**config, "inference": "local", "actor_num": 5000})).actor_num == 5000
    halved = {**config, "double_buffer": True}  # two connections an actor
    assert build_task(json.dumps({**halved, "actor_num": MAX_CENTRAL_ACTORS // 2})).halves == 2
    with pytest.raises(TaskConfigError, match=rf"at most {MAX_CENTRAL_ACTORS // 2} actors .*two when double-buffered"):
        build_task(json.dumps({**halved, "actor_num": MAX_CENTRAL_ACTORS // 2 + 1}))


def test_bad_arguments_on_an_embedded_redis_start_nothing() -> None:
    import srl
    from srl.runner.distribution import RedisParameters
    from tests.nodes import tiny_config

    runner = srl.Runner("Pendulum-v1", tiny_config())
    with pytest.raises(TypeError, match=r"actor_num must be an integer in 1\.\.100000, got 1\.5 \(a float\)"):
        runner.train_distribution(RedisParameters(), actor_num=1.5, max_train_count=10)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- replacing and re-attaching
RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672/"

KILLED_CLIENT = """
import srl
from srl.runner.distribution import RedisParameters
from tests.nodes import tiny_config
runner = srl.Runner("Pendulum-v1", tiny_config())
runner.train_distribution(RedisParameters(url={url!r}, task_name={ns!r}), {queue!r}, actor_num=2,
                          max_train_count=10**9, progress_interval=0.5)
"""


def _client_process(tmp_path: Path, name: str, code: str) -> tuple[subprocess.Popen[bytes], Path]:
    log = tmp_path / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT,
                                cwd=Path(__file__).parent.parent)
    return proc, log


@pytest.mark.slow
@pytest.mark.parametrize("queue", [None, RABBITMQ_URL], ids=["redis", "amqp"])
def test_replacing_a_running_task_moves_its_standing_nodes_to_the_new_one(
    redis_url: str, namespace: str, tmp_path: Path, nodes: list[Node], queue: str | None
) -> None:
    """A client is SIGKILLed mid-run; a new client replaces its task (overwrite=True, another env). The
    standing trainer and actors drop the old run, build the new task and finish it; none of them exits."""
    if queue is not None and not port_open("127.0.0.1", 5672):
        broker_unavailable("RabbitMQ", "127.0.0.1", 5672)
    queue_args = () if queue is None else ("--queue-url", queue)
    trainer = start(nodes, "trainer", redis_url, namespace, tmp_path, *queue_args)
    actors = [start(nodes, "actor", redis_url, namespace, tmp_path, *queue_args) for _ in range(2)]
    board = board_for(redis_url, namespace)
    proc, _ = _client_process(tmp_path, "first-client",
                                KILLED_CLIENT.format(url=redis_url, ns=namespace, queue=queue))
    try:
        wait_for(lambda: (st := board.get_status()) is not None and st.train_count > 0, 90, "the first task to train")
        proc.kill()
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    runner = srl.Runner("CartPole-v1", tiny_config())
    client = ClientThread(runner, RedisParameters(url=redis_url, task_name=namespace), queue_params=queue,
                          actor_num=2, max_train_count=300, overwrite=True, progress_interval=1.0)
    client.start()
    client.join(120)
    assert not client.is_alive(), "the new task did not finish: " + trainer.output()[-3000:]
    assert client.error is None, client.error
    assert runner.train_count >= 300
    status = board.get_status()
    assert status is not None and status.status == TaskState.END and "max_train_count 300" in status.end_reason
    for node in (trainer, *actors):
        assert node.alive(), node.output()[-3000:]  # each served the new task and waits for the next
        out = node.output()
        assert "replaced by a new task of the same name" in out, out[-3000:]
        assert "crashed" not in out and "Traceback" not in out, out[-3000:]
    assert all("CartPole-v1" in actor.output() for actor in actors)


# --------------------------------------------------------------------------- credentials
def _srl(*args: str, timeout: float = 60, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "srl.cli", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.mark.slow
def test_bad_redis_credentials_fail_at_once_on_the_client_and_on_nodes(tmp_path: Path) -> None:
    """No password, or a wrong one, against a Redis with requirepass: an error that says so within seconds,
    not 50 s of "check that Redis is running", and nodes that exit instead of retrying for ever."""
    with running(PrivateRedis(password="s3cret")) as server:
        runner = srl.Runner("Pendulum-v1", tiny_config())
        for params, says in ((RedisParameters(url=server.url), "it needs a password and none was given"),
                             (RedisParameters(url=server.url, password="wrong"), "invalid username-password pair")):
            started = time.monotonic()
            with pytest.raises(CredentialsError, match=rf"authentication failed for Redis at 127\.0\.0\.1:"
                                                       rf"{server.port} \({says}.*\): check the password/user"):
                runner.train_distribution(params, max_train_count=10, progress_interval=None)
            assert time.monotonic() - started < 10
        wrong = tmp_path / "wrong-password"
        wrong.write_text("wrong\n")
        for role in ("actor", "trainer"):
            done = _srl(role, "--url", server.url, "--password-file", str(wrong))
            assert done.returncode == 1, done.stderr
            assert "authentication failed for Redis" in done.stderr and "Traceback" not in done.stderr, done.stderr
        done = _srl("status", "--url", server.url, "--password-file", str(wrong))
        assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
        assert done.stderr.startswith("srl: authentication failed for Redis"), done.stderr


@pytest.mark.slow
def test_bad_queue_credentials_fail_before_submitting_and_end_the_node_not_the_task(
    redis_url: str, namespace: str, tmp_path: Path, nodes: list[Node]
) -> None:
    """A client checks the queue's login before it writes the task; a node the queue refuses exits with the
    reason and says on the board why it refuses, and the task waits for a node that can serve it."""
    if not port_open("127.0.0.1", 5672):
        broker_unavailable("RabbitMQ", "127.0.0.1", 5672)
    runner = srl.Runner("Pendulum-v1", tiny_config())
    redis_params = RedisParameters(url=redis_url, task_name=namespace)
    with pytest.raises(CredentialsError, match=r"authentication failed for RabbitMQ at .*ACCESS_REFUSED.*check the "
                                               r"user and password"):
        runner.train_distribution(redis_params, "amqp://guest:wrong@127.0.0.1:5672/", max_train_count=10,
                                  progress_interval=None)
    board = board_for(redis_url, namespace)
    assert board.get_status() is None  # nothing was submitted
    client = ClientThread(runner, redis_params, queue_params=RABBITMQ_URL, max_train_count=10**9)
    client.start()
    try:
        wait_for(lambda: (st := board.get_status()) is not None and st.status == TaskState.ACTIVE, 60, "the task")
        actor = start(nodes, "actor", redis_url, namespace, tmp_path, "--queue-url", "amqp://guest:wrong@127.0.0.1:5672/")
        assert actor.proc.wait(timeout=60) == 1
        assert "authentication failed for RabbitMQ" in actor.output() and "Traceback" not in actor.output()
        status = board.get_status()
        assert status is not None and status.status == TaskState.ACTIVE  # the task is fine; the node was not
        assert board.held_leases(1) == []  # the slot it took is free again
        lines = "\n".join(progress_lines(board, status, 1.0))
        assert re.search(r"actor 0: MISSING for \S+ — actor-\S+ refuses the task: its credentials were refused: "
                         r"authentication failed for RabbitMQ", lines), lines
    finally:
        board.end_task(TaskState.END, "test over")
        client.join(30)


@pytest.mark.slow
def test_bad_mqtt_credentials_fail_before_submitting(redis_url: str, namespace: str) -> None:
    with running(PrivateMosquitto(users={"srl": "s3cret"})) as server:
        runner = srl.Runner("Pendulum-v1", tiny_config())
        for url in (server.url, server.url.replace("mqtt://", "mqtt://srl:wrong@")):
            with pytest.raises(CredentialsError, match=r"authentication failed for the MQTT broker .*Not authorized"):
                runner.train_distribution(RedisParameters(url=redis_url, task_name=namespace), url,
                                          max_train_count=10, progress_interval=None)
        assert board_for(redis_url, namespace).get_status() is None


def test_pubsub_and_redis_acl_refusals_are_credential_errors() -> None:
    """The emulator checks no credentials, so Google's refusals are classified from the errors its client
    raises; a Redis user without a command srl needs is a refusal too, not a crash or an outage."""
    from google.api_core import exceptions as gexc

    from srl.runner.distribution.node.retry import with_retry
    from srl.runner.distribution.queues.pubsub import PubSubQueue
    from srl.runner.distribution.settings.queue_parameters import GCPParameters

    holder = SimpleNamespace(params=GCPParameters(project_id="p"))
    denied = PubSubQueue._refusal(holder, gexc.PermissionDenied("caller lacks pubsub.topics.publish"))  # type: ignore[arg-type]
    assert isinstance(denied, CredentialsError) and "Pub/Sub Editor role" in str(denied)
    unknown = PubSubQueue._refusal(holder, gexc.Unauthenticated("no token"))  # type: ignore[arg-type]
    assert isinstance(unknown, CredentialsError) and str(unknown).startswith("authentication failed for Pub/Sub")
    assert PubSubQueue._refusal(holder, gexc.ServiceUnavailable("blip")) is None  # type: ignore[arg-type]

    def no_permission() -> None:
        raise redis.exceptions.NoPermissionError("this user has no permissions to run the 'evalsha' command")

    with pytest.raises(CredentialsError, match=r"permission denied by Redis .*'evalsha'"):
        with_retry(no_permission, "a board call")


# --------------------------------------------------------------------------- SIGTERM, attach
WATCHING_CLIENT = """
import srl
from srl.runner.distribution import RedisParameters
from tests.nodes import tiny_config
runner = srl.Runner("Pendulum-v1", tiny_config())
runner.train_distribution(RedisParameters(url={url!r}, task_name={ns!r}), max_train_count={count},
                          progress_interval=0.5)
print("TRAIN COUNT", runner.train_count)
"""


@pytest.mark.slow
def test_sigterm_ends_the_task_like_ctrl_c(redis_url: str, namespace: str, tmp_path: Path) -> None:
    """``timeout``, ``kill``, ``docker stop`` or a closed notebook send SIGTERM: the client says so, ends the
    task as cancelled and exits 143, instead of vanishing while the nodes train on."""
    proc, log = _client_process(tmp_path, "client", WATCHING_CLIENT.format(url=redis_url, ns=namespace,
                                                                           count=10**9))
    board = board_for(redis_url, namespace)
    try:
        wait_for(lambda: (s := board.get_status()) is not None and s.status == TaskState.ACTIVE, 60, "the task")
        wait_for(lambda: "MISSING" in log.read_text(), 30, "the first progress lines")
        proc.terminate()
        assert proc.wait(timeout=30) == 143
    finally:
        if proc.poll() is None:
            proc.kill()
    status = board.get_status()
    assert status is not None and status.status == TaskState.END and status.end_reason == "cancelled"
    assert "terminated (SIGTERM): ending task" in log.read_text()


CANCELLED_CLIENT = """
import srl
from srl.runner.distribution import RedisParameters
from tests.nodes import tiny_config
runner = srl.Runner("Pendulum-v1", tiny_config())
runner.train_distribution(RedisParameters(url={url!r}, task_name={ns!r}), max_train_count=10**9,
                          log_dir={log_dir!r}, checkpoint_interval=3600.0, progress_interval=0.5)
"""


@pytest.mark.slow
def test_a_cancelled_task_keeps_the_weights_its_trainer_trained_last(
    redis_url: str, namespace: str, tmp_path: Path, nodes: list[Node]
) -> None:
    """SIGTERM on a client whose task is training: the trainer publishes the weights it trained up to when
    it saw the end (not the last periodic ones, up to publish_every steps older), the client waits for
    them, keeps them in final.safetensors and receives the trainer's final checkpoint into its log_dir."""
    from srl.base.arrays import load_arrays
    from srl.runner.distribution.node.stats import Reports

    trainer = start(nodes, "trainer", redis_url, namespace, tmp_path)
    start(nodes, "actor", redis_url, namespace, tmp_path)
    log_dir = tmp_path / "run"
    proc, log = _client_process(tmp_path, "client", CANCELLED_CLIENT.format(url=redis_url, ns=namespace,
                                                                           log_dir=str(log_dir)))
    board = board_for(redis_url, namespace)
    try:
        wait_for(lambda: (head := board.get_params_head()) is not None and head[2] >= 300, 120, "training")
        proc.terminate()
        assert proc.wait(timeout=60) == 143, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    # the trainer's own end, after its final publication, checkpoint and report: "final params published"
    # is only logged for weights the board does not have yet (none trained since the last publication: none)
    wait_for(lambda: " stopped: task END" in trainer.output(), 120, "the trainer's final publication and report")
    head = board.get_params_head()
    last = Reports.read(board).trainer
    assert head is not None and last is not None and head[2] == last.train_count, (head, last)
    meta, _ = load_arrays(log_dir / "final.safetensors")
    assert meta["train_count"] == head[2], (meta["train_count"], head)
    kept = sorted((log_dir / "checkpoints" / namespace).glob("ckpt-*.safetensors"))
    assert kept and kept[-1].name == f"ckpt-{head[2]:010d}.safetensors", (kept, head)
    assert "waiting up to" in log.read_text()


@pytest.mark.slow
def test_the_same_call_again_attaches_to_the_task_a_killed_client_left(
    redis_url: str, namespace: str, tmp_path: Path, nodes: list[Node]
) -> None:
    """A client killed mid-run leaves its task running; the same call again does not raise TaskExistsError:
    it attaches, watches the task to its end and loads its final params. Another config still may not."""
    start(nodes, "trainer", redis_url, namespace, tmp_path)
    start(nodes, "actor", redis_url, namespace, tmp_path)
    board = board_for(redis_url, namespace)
    proc, _ = _client_process(tmp_path, "killed", WATCHING_CLIENT.format(url=redis_url, ns=namespace, count=1500))
    try:
        wait_for(lambda: (s := board.get_status()) is not None and s.train_count > 0, 90, "training")
        proc.kill()
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    redis_params = RedisParameters(url=redis_url, task_name=namespace)
    other = srl.Runner("Pendulum-v1", tiny_config(lr=0.01))
    with pytest.raises(TaskExistsError, match=r"with another config \(rl_config\.lr\)"):
        other.train_distribution(redis_params, max_train_count=1500, progress_interval=None)
    runner = srl.Runner("Pendulum-v1", tiny_config())
    runner.train_distribution(redis_params, max_train_count=1500, progress_interval=None)  # the same call
    status = board.get_status()
    assert status is not None and status.status == TaskState.END and "max_train_count 1500" in status.end_reason
    assert runner.train_count == status.train_count >= 1500 and runner.parameter.version == status.params_version
    # attach=True to the ended task: its final params and end, again; to no task: a clear error
    again = srl.Runner("Pendulum-v1", tiny_config())
    again.train_distribution(redis_params, max_train_count=1500, progress_interval=None, attach=True)
    assert again.train_count == runner.train_count
    with pytest.raises(TaskNotFoundError, match="to attach to"):
        again.train_distribution(RedisParameters(url=redis_url, task_name=namespace + "-none"),
                                 max_train_count=1500, attach=True)


@pytest.mark.slow
def test_ctrl_c_or_sigterm_on_an_attached_client_detaches_and_the_task_goes_on(
    redis_url: str, namespace: str, tmp_path: Path, nodes: list[Node]
) -> None:
    """Only the client that submitted a task ends it when interrupted (or ``srl stop``): a second client that
    attached to watch it detaches on Ctrl-C or SIGTERM, and the submitter's run goes on to its budget."""
    board = board_for(redis_url, namespace)
    script = WATCHING_CLIENT.format(url=redis_url, ns=namespace, count=300)
    submitter, submitter_log = _client_process(tmp_path, "submitter", script)
    watchers: list[subprocess.Popen[bytes]] = []
    try:
        wait_for(lambda: (s := board.get_status()) is not None and s.status == TaskState.ACTIVE, 60, "the task")
        interrupted, interrupted_log = _client_process(tmp_path, "interrupted", script)
        terminated, terminated_log = _client_process(tmp_path, "terminated", script)
        watchers = [interrupted, terminated]
        for log in (interrupted_log, terminated_log):  # no node serves the task yet: it cannot end meanwhile
            wait_for(lambda log=log: "MISSING" in log.read_text(), 60, "the attached client's progress lines")
            assert "attaching to it" in log.read_text()
        interrupted.send_signal(signal.SIGINT)
        terminated.terminate()
        interrupted.wait(timeout=60)
        assert terminated.wait(timeout=60) == 143, terminated_log.read_text()
        status = board.get_status()
        assert status is not None and status.status == TaskState.ACTIVE, status
        for log in (interrupted_log, terminated_log):
            assert f"detaching from task {namespace!r}" in log.read_text(), log.read_text()
            assert "srl stop --url" in log.read_text() and "ending task" not in log.read_text()
        start(nodes, "trainer", redis_url, namespace, tmp_path)
        start(nodes, "actor", redis_url, namespace, tmp_path)
        assert submitter.wait(timeout=300) == 0, submitter_log.read_text()
    finally:
        for proc in (submitter, *watchers):
            if proc.poll() is None:
                proc.kill()
    status = board.get_status()
    assert status is not None and status.status == TaskState.END and "max_train_count 300" in status.end_reason
    assert "TRAIN COUNT" in submitter_log.read_text()


# --------------------------------------------------------------------------- refusals on the board
@pytest.mark.slow
def test_the_client_says_which_node_refuses_the_task_and_why(
    redis_url: str, namespace: str, tmp_path: Path, nodes: list[Node], caplog: pytest.LogCaptureFixture
) -> None:
    """An actor with another SRL_SECRET and a trainer with none refuse the task; the client's progress lines
    say who refuses and why where they used to say only 'MISSING — start one'."""
    caplog.set_level("INFO", logger="srl.client")
    runner = srl.Runner("Pendulum-v1", tiny_config())
    client = ClientThread(runner, RedisParameters(url=redis_url, task_name=namespace), max_train_count=10**9,
                          secret="the-right-one", progress_interval=0.3)
    client.start()
    board = board_for(redis_url, namespace)
    try:
        wait_for(lambda: (s := board.get_status()) is not None and s.status == TaskState.ACTIVE, 60, "the task")
        start(nodes, "actor", redis_url, namespace, tmp_path, env={"SRL_SECRET": "another"})
        start(nodes, "trainer", redis_url, namespace, tmp_path, env={"SRL_SECRET": ""})
        actor_line = r"actor 0: MISSING for \S+ — actor-\S+ refuses the task: .*signature does not match.*is " \
                     r"SRL_SECRET the same everywhere\?"
        trainer_line = r"trainer: MISSING for \S+ — trainer-\S+ refuses the task: the task config is signed but no " \
                       r"secret is set on this node"
        wait_for(lambda: re.search(actor_line, caplog.text) and re.search(trainer_line, caplog.text), 60,
                 "progress lines naming the refusals")
    finally:
        board.end_task(TaskState.END, "test over")
        client.join(30)


# --------------------------------------------------------------------------- a Redis that lost the task
@pytest.mark.slow
def test_a_task_lost_with_its_redis_is_named_so_and_nothing_comes_back(tmp_path: Path, nodes: list[Node]) -> None:
    """FLUSHALL (or a Redis restarted without persistence) mid-run: the client and the nodes say the task is
    gone from the board, not 'fenced off by another trainer'; the trainer writes its final checkpoint; the
    nodes recreate no key of it (no orphan stream) and wait for the next task."""
    from srl.runner.distribution.client.train import TaskFailedError

    with running(PrivateRedis()) as server:
        name, checkpoints = "lost", tmp_path / "checkpoints"
        trainer = start(nodes, "trainer", server.url, name, tmp_path, "--checkpoint-dir", str(checkpoints))
        actors = [start(nodes, "actor", server.url, name, tmp_path) for _ in range(2)]
        runner = srl.Runner("Pendulum-v1", tiny_config())
        client = ClientThread(runner, RedisParameters(url=server.url, task_name=name), actor_num=2,
                              max_train_count=10**9)
        client.start()
        board = board_for(server.url, name)
        wait_for(lambda: (s := board.get_status()) is not None and s.train_count > 0, 90, "training")
        board.client.flushall()
        client.join(30)
        assert isinstance(client.error, TaskFailedError) and "gone from the board" in str(client.error)
        for node in (trainer, *actors):
            wait_for(lambda: "stopped: the task is gone from the board" in node.output(), 30,  # noqa: B023
                     f"the {node.role} to stop its run")
        assert "fenced off" not in trainer.output()
        assert list((checkpoints / name).glob("ckpt-*.safetensors")), "no final checkpoint"
        assert list(board.client.scan_iter(match="srl:{lost}:*")) == []
        assert all(node.alive() for node in (trainer, *actors))


# --------------------------------------------------------------------------- status that does not mislead
def test_status_of_an_ended_task_asks_for_no_node_and_its_clock_stops(
    redis_url: str, namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from srl.cli import main

    board = board_for(redis_url, namespace)
    board = board.bound(board.create_task({**srl.Runner("Pendulum-v1", tiny_config()).task_config(),
                                           "actor_num": 2, "max_train_count": 5}).task_id)
    board.set_active()
    args = ["status", "--url", redis_url, "--task-name", namespace]
    assert main(args) == 0
    running_out = capsys.readouterr().out
    assert f"start one: srl trainer --url {redis_url} --task-name {namespace}" in running_out
    board.end_task("END", "max_train_count 5 reached")
    assert main(args) == 0
    first = capsys.readouterr().out
    time.sleep(1.1)  # the passing of time is what is under test: an ended task's clock must not move
    assert main(args) == 0
    second = capsys.readouterr().out
    assert "MISSING" not in first and "start one" not in first, first
    assert "trainer: none (the task has ended)" in first and "actor 1: none (the task has ended)" in first
    assert first.splitlines()[0] == second.splitlines()[0] and "task END ended after" in first


def test_start_hints_name_everything_a_node_needs_to_reach_the_task() -> None:
    from srl.runner.distribution.client.report import NodeHints

    hints = NodeHints.of(RedisParameters(host="redis.example", port=6390, task_name="pong", password="x"),
                         "amqp://bob@rabbit.example:5672/")
    assert hints.command("actor") == ("srl actor --host redis.example --port 6390 --task-name pong --password-file "
                                      "FILE --queue-url amqp://bob@rabbit.example:5672/")
    assert NodeHints.of(RedisParameters(url="rediss://:pw@r.example:6380/2")).command("trainer") == \
        "srl trainer --url rediss://r.example:6380/2"


def test_the_nodes_of_a_replaced_task_write_nothing_into_the_new_one(redis_url: str, namespace: str) -> None:
    """What a trainer or an actor of the old task still does after a client replaced it lands nowhere: no
    stale stats ("train 12199/5000"), counters, events with a blank name, leases or params."""
    board = board_for(redis_url, namespace)
    config = {**srl.Runner("Pendulum-v1", tiny_config()).task_config(), "actor_num": 1}
    old = board.bound(board.create_task(config).task_id)
    assert old.claim_trainer("t-old", 60_000) == 1
    new = board.bound(board.create_task(config, overwrite=True).task_id)
    old.put_stats("trainer", {"train_count": 12199})
    old.incr_counters("trainer", received_batches=5)
    old.log_event("trainer t-old (epoch 1) fenced off by trainer  (epoch 0)")
    old.note_refusal("actor-x", "actor", "a reason of the old task")
    heartbeat = old.heartbeat("trainer", "t-old", 60_000, "trainer", {"train_count": 12199}, {"received_batches": 1})
    assert heartbeat.replaced and not heartbeat
    assert old.claim_trainer("t-old", 60_000) is None and old.claim_actor_slot("a-old", 1, 60_000) is None
    assert old.reclaim_trainer("t-old", 1, 60_000) == "replaced"
    assert not old.publish_params("t-old", 1, 1, b"params", 10)
    assert new.claim_trainer("t-new", 60_000) == 1 and new.publish_params("t-new", 1, 1, b"new params", 10)
    assert old.get_params() is None and new.get_params().blob == b"new params"  # type: ignore[union-attr]
    assert new.release_lease("trainer", "t-new")
    assert old.count_received("t-old", {"received_batches": 1}, []) == "not ours"
    assert not old.end_task("FAILED", "the old task's trainer crashed")
    assert new.get_all_stats() == {} and new.get_counters() == {} and new.get_events() == []
    assert new.get_refusals() == [] and new.held_leases(1) == []
    status = new.get_status()
    assert status is not None and status.status == TaskState.INIT
    board.delete_task()


def test_progress_never_shows_more_batches_received_than_sent(redis_url: str, namespace: str) -> None:
    board = board_for(redis_url, namespace)
    board = board.bound(board.create_task({**srl.Runner("Pendulum-v1", tiny_config()).task_config()}).task_id)
    board.set_active()
    board.incr_counters("actor:0", sent_batches=3)  # actors report at their heartbeats...
    board.incr_counters("trainer", received_batches=5)  # ...the trainer as batches come
    status = board.get_status()
    assert status is not None
    assert "batches sent 5 received 5 (in flight ~0)" in progress_lines(board, status, 1.0)[0]
    board.delete_task()


def test_a_progress_line_reads_every_slots_lease_at_once(tmp_path: Path) -> None:
    """A progress line costs the same Redis commands for 8 actor slots as for 400 (every lease in one MGET):
    at 1,000 slots and 20 ms to Redis, a read per slot would take 20 s a line, during which the client sees
    neither the task's end nor its own timeout. Counted on a Redis of the test's own, which nothing else
    talks to."""
    from srl.runner.distribution.board.board import Board

    config = srl.Runner("Pendulum-v1", tiny_config()).task_config()
    with running(PrivateRedis()) as server:
        client = redis.Redis.from_url(server.url)

        def commands_for_a_line(actor_num: int) -> int:
            board = Board(client, f"slots{actor_num}")
            board = board.bound(board.create_task({**config, "actor_num": actor_num}).task_id)
            board.set_active()
            assert board.claim_lease("trainer", "trainer-x", 60_000)
            for slot in range(0, actor_num, 2):  # half the slots held, half missing
                assert board.claim_lease(f"actor:{slot}", f"actor-{slot}", 60_000)
            status = board.get_status()
            assert status is not None
            before = int(client.info("stats")["total_commands_processed"])
            lines = progress_lines(board, status, 1.0)
            after = int(client.info("stats")["total_commands_processed"])
            assert len(lines) == 2 + actor_num, lines
            assert lines[2].startswith("  actor 0 actor-0:") and "actor 1: MISSING" in lines[3], lines[:4]
            return after - before

        few, many = commands_for_a_line(8), commands_for_a_line(400)
        client.close()
    assert many == few, f"a progress line took {few} commands for 8 actor slots and {many} for 400"


def test_a_progress_line_is_one_round_trip_whatever_the_number_of_actors(monkeypatch: pytest.MonkeyPatch) -> None:
    """Everything a progress line reads of the board (stats, counters, params head, config, refusals, every
    lease, where central inference listens) is one pipeline: one request to Redis, and the same commands, for
    8 actor slots as for 400. Requests are counted as the client sends them; commands on a Redis of the test's
    own, which nothing else talks to."""
    from srl.runner.distribution.board.board import Board

    sent = [0]
    send = redis.connection.AbstractConnection.send_packed_command

    def counted(self: redis.connection.AbstractConnection, command: object, check_health: bool = True) -> None:
        sent[0] += 1
        send(self, command, check_health)

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counted)
    config = {**srl.Runner("Pendulum-v1", tiny_config()).task_config(), "inference": "central"}
    with running(PrivateRedis()) as server:
        client = redis.Redis.from_url(server.url)

        def cost_of_a_line(actor_num: int) -> tuple[int, int]:
            board = Board(client, f"trips{actor_num}")
            board = board.bound(board.create_task({**config, "actor_num": actor_num}).task_id)
            board.set_active()
            assert board.claim_lease("trainer", "trainer-x", 60_000)
            assert board.heartbeat("trainer", "trainer-x", 60_000, "trainer", {"train_count": 7},
                                   {"received_batches": 2})
            assert board.claim_lease("inference", "inference-x", 60_000)
            assert board.set_inference_address("inference-x", "127.0.0.1:5000", tls=False)
            assert board.heartbeat("inference", "inference-x", 60_000, "inference", {"sessions": 1})
            for slot in range(0, actor_num, 2):  # half the slots held and reporting, half missing
                assert board.claim_lease(f"actor:{slot}", f"actor-{slot}", 60_000)
                assert board.heartbeat(f"actor:{slot}", f"actor-{slot}", 60_000, f"actor:{slot}", {"envs": 1},
                                       {"sent_batches": 1})
            board.note_refusal("actor-y", "actor", "its env does not build")
            status = board.get_status()
            assert status is not None
            commands, requests = int(client.info("stats")["total_commands_processed"]), sent[0]
            lines = progress_lines(board, status, 1.0)
            requests = sent[0] - requests
            commands = int(client.info("stats")["total_commands_processed"]) - commands
            assert len(lines) == 3 + actor_num, lines
            assert lines[1].startswith("  trainer trainer-x") and "train 7 " in lines[0], lines[:2]
            assert lines[2].startswith("  inference inference-x at 127.0.0.1:5000: 1 actor(s) connected"), lines[2]
            assert lines[3].startswith("  actor 0 actor-0: ") and "1 env(s)" in lines[3], lines[3]
            assert "actor 1: MISSING" in lines[4] and "actor-y refuses the task: its env does not build" in lines[4]
            return requests, commands

        few, many = cost_of_a_line(8), cost_of_a_line(400)
        client.close()
    assert few[0] == many[0] == 1, f"a progress line sent {few[0]} requests for 8 actor slots, {many[0]} for 400"
    assert few[1] == many[1], f"a progress line took {few[1]} commands for 8 actor slots and {many[1]} for 400"


# --------------------------------------------------------------------------- counts that add up
@pytest.mark.slow
@pytest.mark.parametrize("queue", [None, RABBITMQ_URL, "mqtt://127.0.0.1:1883"], ids=["redis", "amqp", "mqtt"])
def test_the_batch_counts_add_up_after_a_trainer_is_killed(
    redis_url: str, namespace: str, tmp_path: Path, nodes: list[Node], queue: str | None,
    caplog: pytest.LogCaptureFixture
) -> None:
    """A trainer SIGKILLed mid-run, another finishes: the end-of-run summary accounts for every batch sent
    (received + refused + still queued), none counted twice, none lost from the counts."""
    port = 1883 if queue and queue.startswith("mqtt") else 5672
    if queue is not None and not port_open("127.0.0.1", port):
        broker_unavailable(queue.partition(":")[0], "127.0.0.1", port)
    caplog.set_level("INFO", logger="srl.client")
    queue_args = () if queue is None else ("--queue-url", queue)
    board = board_for(redis_url, namespace)
    first = start(nodes, "trainer", redis_url, namespace, tmp_path, *queue_args)
    for _ in range(2):
        start(nodes, "actor", redis_url, namespace, tmp_path, *queue_args)
    runner = srl.Runner("Pendulum-v1", tiny_config())
    client = ClientThread(runner, RedisParameters(url=redis_url, task_name=namespace), queue_params=queue,
                          actor_num=2, max_train_count=2500, progress_interval=5.0)
    client.start()
    wait_for(lambda: (s := board.get_status()) is not None and s.train_count >= 500, 120, "training")
    first.proc.kill()
    first.proc.wait(10)
    start(nodes, "trainer", redis_url, namespace, tmp_path, *queue_args)
    client.join(180)
    assert client.error is None, client.error
    accounts = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("  batches: sent"))
    if queue is None or queue.startswith("amqp"):
        assert accounts.endswith(": all accounted for"), accounts
    else:  # MQTT does not tell its queue's depth: what is left is queued or in flight, never negative
        assert re.fullmatch(r"  batches: sent \d+ = received \d+ \+ refused 0 \+ \d+ still queued or in flight .*",
                            accounts), accounts
    assert board.get_counters().get("duplicates", 0) >= 0


# --------------------------------------------------------------------------- checkpoints through the board
@pytest.mark.slow
def test_a_remote_trainers_checkpoints_reach_the_log_dir_and_a_run_resumes_from_them(
    redis_url: str, namespace: str, tmp_path: Path, nodes: list[Node]
) -> None:
    """The trainer runs elsewhere with no checkpoint directory (a notebook's disk goes with it): its
    checkpoints, replay memory included, come through the board into the client's log_dir, and
    ``resume_from=log_dir`` goes on from them, memory and all."""
    from srl.base.arrays import load_arrays

    trainer = start(nodes, "trainer", redis_url, namespace, tmp_path)
    start(nodes, "actor", redis_url, namespace, tmp_path)
    redis_params = RedisParameters(url=redis_url, task_name=namespace)
    log_dir = tmp_path / "run"
    runner = srl.Runner("Pendulum-v1", tiny_config())
    runner.train_distribution(redis_params, max_train_count=600, log_dir=log_dir, checkpoint_interval=0.5,
                              checkpoint_memory=True, progress_interval=None)
    kept = sorted((log_dir / "checkpoints" / namespace).glob("ckpt-*.safetensors"))
    assert kept and kept[-1].name == "ckpt-0000000600.safetensors", kept
    meta, arrays = load_arrays(kept[-1])
    assert meta["memory_state"]["kind"] == "proportional" and "memory/rows/obs" in arrays
    rows = len(arrays["memory/rows/obs"])
    assert rows >= 200  # at least the warmup's
    resumed = srl.Runner("Pendulum-v1", tiny_config())
    resumed.train_distribution(redis_params, max_train_count=200, resume_from=log_dir, progress_interval=None)
    assert resumed.train_count == 800
    assert f"the checkpoint's replay memory is back: {rows} rows" in trainer.output()


@pytest.mark.slow
def test_train_distribution_goes_on_from_what_the_runner_trained_here(
    redis_url: str, namespace: str, tmp_path: Path, nodes: list[Node]
) -> None:
    """``runner.train(); runner.train_distribution()``: the trainer starts from the runner's weights, optimizer
    state and counters (as from a checkpoint), the budget counts from there as a second ``train`` call's would,
    and the runner ends with the run's totals, its own steps counted once."""
    trainer = start(nodes, "trainer", redis_url, namespace, tmp_path)
    start(nodes, "actor", redis_url, namespace, tmp_path)
    runner = srl.Runner("Pendulum-v1", tiny_config())
    runner.train(max_train_count=300, progress_interval=None, checkpoint_interval=None)
    local_steps, local_version = runner.env_steps, runner.parameter.version
    assert runner.train_count == 300
    runner.train_distribution(RedisParameters(url=redis_url, task_name=namespace), max_train_count=200,
                              progress_interval=None)
    assert f"resumed from a checkpoint: version {local_version}, train_count 300" in trainer.output()
    board = board_for(redis_url, namespace)
    status = board.get_status()
    assert status is not None and "max_train_count 500" in status.end_reason, status
    assert runner.train_count == status.train_count >= 500
    assert runner.env_steps == int(board.get_counters()["env_steps"]) > local_steps


# --------------------------------------------------------------------------- the command line
def test_cli_errors_are_one_line_with_the_usual_exit_codes(redis_url: str, namespace: str, tmp_path: Path) -> None:
    from tests.queue_fixtures import closed_port

    closed = str(closed_port())
    for args, code, says in [
        (["status", "--host", "127.0.0.1", "--port", closed], 1, f"cannot reach Redis at redis://127.0.0.1:{closed}/0"),
        (["stop", "--host", "127.0.0.1", "--port", closed], 1, f"cannot reach Redis at redis://127.0.0.1:{closed}/0"),
        (["status", "--url", redis_url, "--task-name", "bad name!"], 2, "task name 'bad name!' is not allowed"),
        (["plot", str(tmp_path / "nowhere")], 2, "history.csv is missing or empty"),
        (["actor", "--url", redis_url, "--queue-url", "kafka://x:1/"], 2, "No such queue backend: 'kafka'"),
        (["trainer", "--url", redis_url, "--queue-url", "amqp://h:notaport/"], 2, "malformed queue URL"),
    ]:
        done = _srl(*args)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == code and len(lines) == 1, (args, done.stderr)
        assert lines[0].startswith("srl: ") and says in lines[0], (args, done.stderr)
    board = board_for(redis_url, namespace)
    board.create_task({**srl.Runner("Pendulum-v1", tiny_config()).task_config(), "actor_num": 20})
    piped = subprocess.run(f"{sys.executable} -m srl.cli status --url {redis_url} --task-name {namespace} | head -1",
                           shell=True, capture_output=True, text=True, timeout=60)
    assert piped.stdout.startswith("task INIT") and piped.stderr == "", piped.stderr
    # a reader gone before srl writes (true reads nothing): a quiet exit, no "Exception ignored" at shutdown;
    # stdout block-buffered, as a pipe's is unless PYTHONUNBUFFERED is set
    buffered = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    closed = subprocess.run(["bash", "-c", f"set -o pipefail; {sys.executable} -m srl.cli status --url {redis_url} "
                             f"--task-name {namespace} | true"], capture_output=True, text=True, timeout=60,
                            env=buffered)
    assert closed.returncode == 128 + 13 and closed.stderr == "", (closed.returncode, closed.stderr)
    board.delete_task()


def test_a_node_whose_queue_library_is_missing_fails_at_startup(redis_url: str, tmp_path: Path) -> None:
    """A node started for an AMQP queue on a machine without pika says so when it starts, with the extra to
    install, instead of taking a task and ending it FAILED when it first opens the queue."""
    (tmp_path / "pika.py").write_text("raise ImportError(\"No module named 'pika'\", name='pika')\n")
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    for role in ("actor", "trainer"):
        done = _srl(role, "--url", redis_url, "--queue-url", "amqp://127.0.0.1:5672/", "--run-once",
                    env={"PYTHONPATH": path}, timeout=60)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 1 and len(lines) == 1, (role, done.stderr)
        assert "needs the 'pika' package" in lines[0] and 'pip install "srl[rabbitmq]"' in lines[0], lines[0]
