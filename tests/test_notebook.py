"""The Colab trainer notebook, executed cell by cell in a real kernel against the local Redis and RabbitMQ.

A client thread submits a small task, one ``srl actor`` process serves it, and
the notebook, configured only through the environment variables its form cell
reads, is the trainer.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import srl
from srl.runner.distribution import RabbitMQParameters, RedisParameters
from srl.runner.distribution.board.board import TaskState
from srl.runner.distribution.queues import open_queue
from tests.nodes import ClientThread, Node, board_for, tiny_config, wait_for
from tests.test_queues import _rabbitmq

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = REPO_ROOT / "examples" / "distribution" / "colab_trainer.ipynb"
MAX_TRAIN_COUNT = 300


def test_notebook_is_clean_nbformat_4() -> None:
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    assert nb.nbformat == 4
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert all(not cell.outputs and cell.execution_count is None for cell in code), "stored outputs"


def notebook_text(nb: object) -> str:
    """Everything the executed cells printed (streams, results, errors)."""
    parts: list[str] = []
    for cell in nb.cells:  # type: ignore[attr-defined]
        for output in cell.get("outputs", []):
            parts.append(output.get("text", ""))
            parts.append(output.get("data", {}).get("text/plain", ""))
            parts.extend(output.get("traceback", []))
    return "\n".join(parts)


def test_notebook_trains_a_task_over_rabbitmq(
    redis_url: str, namespace: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    nbclient = pytest.importorskip("nbclient")
    nbformat = pytest.importorskip("nbformat")
    amqp_url = _rabbitmq().url
    # the kernel inherits this environment; the notebook's form cell reads these
    monkeypatch.setenv("SRL_REDIS_URL", redis_url)
    monkeypatch.setenv("SRL_QUEUE_URL", amqp_url)
    monkeypatch.setenv("SRL_TASK_NAME", namespace)
    monkeypatch.delenv("SRL_SECRET", raising=False)
    monkeypatch.delenv("SRL_REDIS_PASSWORD", raising=False)
    # this interpreter's kernelspec first, whatever a user-wide "python3" kernelspec points at
    monkeypatch.setenv("JUPYTER_PATH", str(Path(sys.prefix) / "share" / "jupyter"))

    nb = nbformat.read(NOTEBOOK, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell('import sys\nprint("KERNEL_PREFIX", sys.prefix)', id="test-prefix"))
    runner = srl.Runner("CartPole-v1", tiny_config())
    client = ClientThread(runner, RedisParameters(url=redis_url, task_name=namespace),
                          queue_params=RabbitMQParameters(url=amqp_url), actor_num=1,
                          max_train_count=MAX_TRAIN_COUNT, local_processes=False)
    board = board_for(redis_url, namespace)
    client.start()
    actor: Node | None = None
    try:
        wait_for(board.get_status, 30, "the client to submit the task")
        actor = Node("actor", redis_url, namespace, tmp_path, "--queue-url", amqp_url, "--run-once")
        try:
            nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                    resources={"metadata": {"path": str(REPO_ROOT)}}).execute()
        except nbclient.exceptions.CellExecutionError as e:
            pytest.fail(f"the notebook failed: {e}\nactor log:\n{actor.output()[-3000:]}")
        client.join(timeout=60)
        assert not client.is_alive(), "the client did not return after the notebook's trainer ended the task"
        assert client.error is None, repr(client.error)
    finally:
        if client.is_alive():  # let the client thread return
            board.end_task("END", "test cleanup")
            client.join(timeout=30)
        if actor is not None:
            actor.stop()
        with open_queue(amqp_url, namespace=namespace, role="consumer") as queue:
            queue.destroy()

    text = notebook_text(nb)
    assert f"KERNEL_PREFIX {sys.prefix}" in text, f"the kernel is not this venv's python:\n{text[-2000:]}"
    assert "device: cuda (" in text or "device: cpu" in text
    assert f"task {namespace!r} END: max_train_count {MAX_TRAIN_COUNT} reached" in text, text[-3000:]
    assert ":guest@" not in text, "a password was printed"  # describe() hides it
    status = board.get_status()
    assert status is not None and status.status == TaskState.END
    assert status.train_count >= MAX_TRAIN_COUNT
    assert runner.train_count >= MAX_TRAIN_COUNT
    board.delete_task()
