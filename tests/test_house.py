"""The shape of the code: no import circles, one table of queue backends that a new backend joins with one
row, and the same rules wherever a concept is used."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRL = Path(__file__).resolve().parents[1] / "srl"


def _import_graph() -> dict[str, set[str]]:
    """srl's modules and the srl modules each imports, at any depth of the file (function-level and
    TYPE_CHECKING imports count: a module never imports one above it)."""
    modules: dict[str, Path] = {}
    for path in SRL.rglob("*.py"):
        parts = list(path.relative_to(SRL.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            for name in names:
                target = resolve(name) if name.startswith("srl") else None
                # a package's __init__ imported by its own modules (for the package itself) is no edge
                if target and target != module and not (modules[target].name == "__init__.py"
                                                        and module.startswith(target + ".")):
                    graph[module].add(target)
    return graph


def test_the_import_graph_of_srl_has_no_cycle() -> None:
    graph = _import_graph()
    state: dict[str, int] = {}  # 1: on the path, 2: done
    cycles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycles.append([*path[path.index(target):], target])
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles[:5])


@pytest.mark.parametrize("module", ["srl.runner.distribution.trainer.run", "srl.runner.distribution.actor.run"])
def test_nodes_do_not_import_the_runner(module: str) -> None:
    """The runner calls the client, which starts nodes: a node importing the runner closes a circle."""
    graph = _import_graph()
    seen, todo = set(), [module]
    while todo:
        current = todo.pop()
        if current not in seen:
            seen.add(current)
            todo.extend(graph[current])
    assert "srl.runner.runner" not in seen and "srl.runner.distribution.client.train" not in seen


def test_a_new_backend_is_one_module_and_one_row() -> None:
    """tests/toy_backend.py (an in-memory queue) joins with one row: URL parsing, describing, opening, local
    nodes' hand-over of its parameters and clearing a task's leftovers all read the table."""
    from srl.runner.distribution import queues
    from srl.runner.distribution.client import local_nodes

    row = queues.Backend("toy", ("toy",), "tests.toy_backend:ToyParameters", "tests.toy_backend:ToyQueue")
    queues.register(row)
    try:
        params = queues.parse_queue_url("toy://lab")
        assert type(params).__name__ == "ToyParameters" and queues.describe_queue("toy://lab") == "toy://lab"
        assert queues.queue_scheme(params) == "toy" and queues.queue_scheme("toy://lab") == "toy"
        assert local_nodes._params_from_data(local_nodes._params_to_data(params)) == params
        with queues.open_queue(params, namespace="ns", role="producer") as producer:
            producer.put_many([b"one", b"two"])
        with queues.open_queue("toy://lab", namespace="ns", role="consumer") as consumer:
            messages = consumer.get_many(16, timeout=1.0)
            assert [m.data for m in messages] == [b"one", b"two"]
            consumer.ack_many(messages[:1])
        assert queues.discard_leftovers(params, namespace="ns") == 1  # the unacked one came back, then went
        with pytest.raises(ValueError, match="already belong to backend"):
            queues.register(queues.Backend("toy2", ("toy", "amqp"), row.parameters, row.queue))
    finally:
        del queues.BACKENDS["toy"]
    with pytest.raises(ValueError, match="No such queue backend: 'toy'"):
        queues.parse_queue_url("toy://lab")


def test_the_dashboard_page_reads_the_names_the_stats_dataclasses_define() -> None:
    """The page's JavaScript reads the trainer's and each actor's stats by name: every name it reads is a field
    of TrainerStats / ActorStats (one definition, which the nodes write and the history reads too)."""
    import dataclasses
    import re

    from srl.runner.distribution.node.stats import ActorStats, TrainerStats

    page = (SRL / "dashboard_static" / "app.js").read_text()
    slots = page[page.index("function renderSlots(task) {"):]
    slots = slots[:slots.index("\n}\n")]  # the function that shows the stats
    assert "const t = task.trainer.stats;" in slots and "const s = actor.stats;" in slots
    trainer_names = set(re.findall(r"\bt\.([a-z_][a-z0-9_]*)", slots))
    actor_names = set(re.findall(r"\bs\.([a-z_][a-z0-9_]*)", slots))
    assert trainer_names and actor_names
    assert trainer_names <= {f.name for f in dataclasses.fields(TrainerStats)}, trainer_names
    assert actor_names <= {f.name for f in dataclasses.fields(ActorStats)}, actor_names


def test_stats_read_from_a_board_fit_their_types_whatever_was_written() -> None:
    from srl.runner.distribution.node.stats import ActorStats, TrainerStats

    written = ActorStats(uid="a", slot=2, env_steps=10, reward=-1.5, extra={"epsilon": 0.4}).to_record()
    assert written["epsilon"] == 0.4 and written["slot"] == 2 and "extra" not in written
    back = ActorStats.from_record({**written, "updated_at": 5.0})
    assert (back.slot, back.env_steps, back.reward, back.extra, back.updated_at) == (2, 10, -1.5, {"epsilon": 0.4}, 5.0)
    forged = TrainerStats.from_record({"train_count": "12199", "memory": float("nan"), "loss": True,
                                       "device": 7, "epoch": 2.5, "huge": 1e400, "x": [1], "duplicates": 10**400,
                                       "beyond": -(10**400)})
    assert (forged.train_count, forged.memory, forged.loss, forged.device, forged.epoch) == (0, 0, None, "", 0)
    assert forged.duplicates == 0  # an int beyond a float's range is no number here, not an OverflowError
    assert forged.extra == {}
    assert TrainerStats.from_record("not a record") == TrainerStats()


DISTRIBUTION = "srl.runner.distribution."
ROLES = ("actor", "trainer", "inference", "client")
"""the folders of srl/runner/distribution that are roles: none imports another; what they share lives below"""
SHARED = ("settings", "wire", "board", "node", "sending", "queues")


def _part(module: str) -> str | None:
    return module[len(DISTRIBUTION):].split(".")[0] if module.startswith(DISTRIBUTION) else None


def test_no_role_imports_another_and_what_roles_share_imports_no_role() -> None:
    """actor/ never imports trainer/, and so on; settings/, wire/, board/, node/, sending/ and queues/ import no
    role (a local node is started through the package's public API, as a user's script does)."""
    graph = _import_graph()
    parts = {_part(m) for m in graph} - {None, ""}
    unknown = sorted(str(part) for part in parts - {*ROLES, *SHARED})
    assert not unknown, f"a folder that is neither a role nor shared: {unknown}"
    crossings = [f"{m} -> {t}" for m, targets in graph.items() for t in targets
                 if _part(t) in ROLES and _part(m) in (*ROLES, *SHARED) and _part(t) != _part(m)]
    assert not crossings, "a role imported from another folder: " + "; ".join(sorted(crossings))


MODULE_LINES = 600
"""the most lines a module under srl/runner holds (an algorithm stays one file, whatever its length)"""
CLASS_LINES = 350
"""the most lines a class in srl spans"""
def test_modules_and_classes_stay_within_their_size() -> None:
    over: list[str] = []
    for path in sorted(SRL.rglob("*.py")):
        text = path.read_text()
        name = str(path.relative_to(SRL.parent))
        lines = len(text.splitlines())
        if name.startswith("srl/runner/") and lines > MODULE_LINES:
            over.append(f"{name}: {lines} lines (at most {MODULE_LINES})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and (span := (node.end_lineno or 0) - node.lineno + 1) > CLASS_LINES:
                over.append(f"{name}:{node.lineno} {node.name}: {span} lines (at most {CLASS_LINES})")
    assert not over, "over its size: " + "; ".join(over) + " (split it where its concerns part)"


def test_an_actor_of_local_inference_never_loads_grpc() -> None:
    """grpc starts threads and an epoll poller from its import on; an actor that acts with its own network has no
    use for them (only central inference, and the Pub/Sub queue, load it)."""
    import subprocess
    import sys

    code = "import sys, srl.cli, srl.runner.distribution.actor.run; print('grpc' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"
