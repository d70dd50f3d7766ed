"""The embedded redis-server: starts, serves other processes over TCP, stops, and dies with its owner."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest
import redis

from srl.runner.distribution.client.embedded import resolve, start_embedded_redis
from srl.runner.distribution.settings.redis_parameters import RedisParameters
from tests.nodes import wait_for


def port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return True
    except OSError:
        return False



def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # a zombie is dead for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def test_start_connect_from_another_process_and_stop() -> None:
    with start_embedded_redis() as server:
        assert server.running and server.url == f"redis://127.0.0.1:{server.port}/0"
        params = server.parameters
        assert (params.host, params.port) == ("127.0.0.1", server.port)
        params.connect().set("k", "from-owner")
        code = (
            "import redis, sys; c = redis.Redis(host='127.0.0.1', port=int(sys.argv[1])); "
            "print(c.get('k').decode()); c.set('k2', 'from-child')"
        )
        out = subprocess.run([sys.executable, "-c", code, str(server.port)], capture_output=True, text=True,
                             timeout=30, check=True)
        assert out.stdout.strip() == "from-owner"
        assert params.connect().get("k2") == b"from-child"
        info = params.connect().info("persistence")
        assert info["aof_enabled"] == 0
        assert params.connect().config_get("save")["save"] == ""
        directory = server.directory
    assert not server.running
    assert not port_open(server.port)
    assert not directory.exists()
    server.stop()  # idempotent


def test_resolve_starts_embedded_only_when_needed() -> None:
    remote = RedisParameters(host="example.invalid", task_name="t")
    assert resolve(remote) == (remote, None)
    embedded = RedisParameters(task_name="mytask")
    with pytest.raises(ValueError, match="embedded"):
        embedded.connect()
    resolved, server = resolve(embedded)
    assert server is not None
    try:
        assert resolved.task_name == "mytask" and resolved.port == server.port and not resolved.is_embedded
        assert resolved.connect().ping()
    finally:
        server.stop()
    assert not port_open(server.port)


def test_server_dies_with_a_sigkilled_owner() -> None:
    owner_code = textwrap.dedent(
        """
        import sys, time, types
        sys.path.insert(0, sys.argv[1])
        # a bare srl package: this throwaway owner needs neither torch nor the Runner (srl/__init__)
        package = types.ModuleType("srl")
        package.__path__ = [sys.argv[1] + "/srl"]
        sys.modules["srl"] = package
        from srl.runner.distribution.client.embedded import start_embedded_redis
        server = start_embedded_redis()
        print(server.port, server.process.pid, flush=True)
        time.sleep(120)
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    owner = subprocess.Popen([sys.executable, "-c", owner_code, os.getcwd()], stdout=subprocess.PIPE, text=True,
                             env=env)
    try:
        assert owner.stdout is not None
        port_text, pid_text = owner.stdout.readline().split()
        port, pid = int(port_text), int(pid_text)
        assert redis.Redis(port=port).ping()
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)
        wait_for(lambda: not pid_alive(pid), 10, f"process {pid} to exit", interval=0.02)
        assert not port_open(port)
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
