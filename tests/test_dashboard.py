"""``srl dashboard``: its JSON endpoints against a real Redis, and the page in a real browser during a live run.

The endpoint tests start the server on an ephemeral port in a thread and put
tasks on the board by hand. The browser test (slow) runs a real distributed
task, watches its numbers move on the page in Debian's chromium (driven by
Playwright), stops it with the page's button and checks the run ends.
"""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

import srl
from srl.cli import build_parser
from srl.dashboard import SHOWN_ACTORS, STOP_REASON, Dashboard, DashboardServer
from srl.runner.distribution import RedisParameters
from srl.runner.distribution.board.board import Board, TaskState, task_key_prefix
from tests.nodes import ClientThread, board_for, tiny_config

CONFIG = json.dumps({"algorithm": "dqn", "env": {"id": "CartPole-v1", "kwargs": {}}, "fields": {}})
CHROMIUM = "/usr/bin/chromium"
SCREENSHOT = Path(__file__).parent / "artifacts" / "dashboard.png"
PAGE = "X-SRL-Dashboard"




@pytest.fixture()
def server(redis_url: str) -> Iterator[DashboardServer]:
    params = RedisParameters(url=redis_url)
    srv = DashboardServer(("127.0.0.1", 0), Dashboard(params.connect(), params.describe()))
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    thread.join(5)


def call(server: DashboardServer, path: str, method: str = "GET",
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    """``(status, JSON body)`` of one request (Host is 127.0.0.1:<port> unless ``headers`` say otherwise)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.request(method, path, headers=headers or {})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def task_row(server: DashboardServer, name: str) -> dict[str, Any]:
    code, body = call(server, "/api/tasks")
    assert code == 200, body
    return next(row for row in body["tasks"] if row["name"] == name)


# --------------------------------------------------------------------------- the JSON endpoints
def test_task_list_shows_each_task_with_its_status(server: DashboardServer, board: Board) -> None:
    board.create_task(CONFIG, actor_num=2)
    row = task_row(server, board.task_name)
    assert row["status"] == "INIT" and row["running"] is True and row["error"] is None
    board.end_task(TaskState.FAILED, "the trainer could not build the env")
    row = task_row(server, board.task_name)
    assert (row["status"], row["end_reason"], row["running"]) == ("FAILED", "the trainer could not build the env",
                                                                  False)


def test_task_detail_has_slots_rates_stalls_lag_counters_and_events(server: DashboardServer, board: Board) -> None:
    board.create_task(CONFIG, actor_num=2)
    board.set_active()
    assert board.claim_trainer("trainer-uid", 10_000) is not None
    board.heartbeat("trainer", "trainer-uid", 10_000, "trainer",
                    {"train_count": 7, "train_per_s": 3.5, "received_per_s": 120.0, "lag_p50": 1.0, "lag_p95": 2.0,
                     "lag_max": 4.0, "loss": 0.25})
    assert board.claim_actor_slot("actor-uid", 2, 10_000, prefer=0) == 0
    board.heartbeat("actor:0", "actor-uid", 10_000, "actor:0",
                    {"env_steps_per_s": 250.0, "backpressure_wait_s": 1.5, "stalled_now_s": 0.5, "reward": 12.0},
                    {"sent_batches": 3, "env_steps": 100})
    board.incr_counters("trainer", received_batches=1, bad_messages=1, refused_batches=1)
    board.incr_counters("actor:0", bad_messages=2)  # params it refused: never sent as batches
    board.log_event("<b>not bold</b>", source="test")

    code, task = call(server, f"/api/task/{board.task_name}")
    assert code == 200 and task["error"] is None, task
    assert (task["status"], task["algorithm"], task["env"], task["train_count"]) == ("ACTIVE", "dqn",
                                                                                     "CartPole-v1", 7)
    trainer = task["trainer"]
    assert trainer["holder"] == "trainer-uid" and 0 <= trainer["heartbeat_age_s"] < 5
    assert {k: trainer["stats"][k] for k in ("train_per_s", "received_per_s", "lag_p50", "lag_p95", "lag_max")} == {
        "train_per_s": 3.5, "received_per_s": 120.0, "lag_p50": 1.0, "lag_p95": 2.0, "lag_max": 4.0}
    first, second = task["actors"]
    assert first["holder"] == "actor-uid" and first["stats"]["env_steps_per_s"] == 250.0
    assert (first["stats"]["backpressure_wait_s"], first["stats"]["stalled_now_s"]) == (1.5, 0.5)
    assert second["holder"] is None and second["heartbeat_age_s"] is None
    counters = task["counters"]
    assert (counters["sent_batches"], counters["received_batches"], counters["bad_messages"]) == (3, 1, 3)
    assert task["batches_in_flight"] == 1  # sent − received − refused, as every view of the queue counts it
    assert task["events"][-1]["text"] == "<b>not bold</b>"  # the page puts it in with textContent
    assert task["curve"]["source"] == "actor reward samples" and task["curve"]["points"][0]["reward_mean"] == 12.0


def test_the_task_view_reads_every_shown_slots_lease_at_once() -> None:
    """The task view costs the same Redis commands for 8 actor slots as for the most it shows (every lease in
    one MGET): a read per slot cost a round trip each, 64 per refresh of the page. Counted on a Redis of the
    test's own, which nothing else talks to."""
    from tests.conftest import running
    from tests.queue_fixtures import PrivateRedis

    with running(PrivateRedis()) as redis_server:
        client = redis.Redis.from_url(redis_server.url)
        dashboard = Dashboard(client, "a private redis")

        def commands_for_a_view(actor_num: int) -> int:
            board = Board(client, f"slots{actor_num}")
            board.create_task(CONFIG, actor_num=actor_num)
            board.set_active()
            assert board.claim_trainer("trainer-x", 60_000) is not None
            for slot in range(0, actor_num, 2):  # half the slots held, half free
                assert board.claim_lease(f"actor:{slot}", f"actor-{slot}", 60_000)
            dashboard.task(board.task_name)  # the first view of a task samples its rewards apart
            before = int(client.info("stats")["total_commands_processed"])
            task = dashboard.task(board.task_name)
            after = int(client.info("stats")["total_commands_processed"])
            assert task is not None and task["error"] is None, task
            assert task["trainer"]["holder"] == "trainer-x"
            assert len(task["actors"]) == min(actor_num, SHOWN_ACTORS)
            assert [a["holder"] for a in task["actors"][:3]] == ["actor-0", None, "actor-2"]
            return after - before

        few, many = commands_for_a_view(8), commands_for_a_view(SHOWN_ACTORS + 10)
        client.close()
    assert many == few, f"the task view took {few} commands for 8 actor slots and {many} for {SHOWN_ACTORS} shown"


def test_reward_curve_samples_actor_rewards_until_history_rows_exist(server: DashboardServer, board: Board) -> None:
    board.create_task(CONFIG, actor_num=1)
    board.put_stats("actor:0", {"reward": 1.0})
    call(server, f"/api/task/{board.task_name}")
    board.put_stats("actor:0", {"reward": 3.0})
    call(server, f"/api/task/{board.task_name}")
    _, task = call(server, f"/api/task/{board.task_name}")  # no new report: no new point
    assert [p["reward_mean"] for p in task["curve"]["points"]] == [1.0, 3.0]

    board.push_history({"time": time.time(), "env_steps": 500, "reward_mean": 20.0, "reward_min": 10.0,
                        "reward_max": 30.0})
    board.push_history({"time": time.time(), "env_steps": 1000, "reward_mean": 40.0, "eval_mean": 55.0})
    _, task = call(server, f"/api/task/{board.task_name}")
    assert task["curve"]["source"] == "history"
    assert [(p["x"], p["reward_mean"], p["eval_mean"]) for p in task["curve"]["points"]] == [
        (500, 20.0, None), (1000, 40.0, 55.0)]


def test_bad_task_names_are_400_and_missing_tasks_404(server: DashboardServer, namespace: str) -> None:
    for bad in ("bad%20name", "..%2F..%2Fetc", "a" * 129, "%7Bbraces%7D", "x%00y"):
        code, body = call(server, f"/api/task/{bad}")
        assert code == 400 and "is not allowed" in body["error"], (bad, body)
    code, _ = call(server, "/api/task/bad%20name/stop", "POST", {PAGE: "1"})
    assert code == 400
    code, body = call(server, f"/api/task/{namespace}")
    assert code == 404 and namespace in body["error"]
    code, _ = call(server, f"/api/task/{namespace}/stop", "POST", {PAGE: "1"})
    assert code == 404
    assert call(server, "/nothing-here")[0] == 404


def test_stop_refuses_requests_another_site_could_make(server: DashboardServer, board: Board) -> None:
    board.create_task(CONFIG)
    path = f"/api/task/{board.task_name}/stop"
    own_origin = f"http://127.0.0.1:{server.port}"
    refused = [
        {},  # a cross-site form cannot set the header
        {PAGE: "0"},
        {PAGE: "1", "Origin": "http://evil.example"},
        {PAGE: "1", "Origin": own_origin, "Sec-Fetch-Site": "cross-site"},
        {PAGE: "1", "Host": f"evil.example:{server.port}"},  # DNS rebinding
    ]
    for headers in refused:
        code, _ = call(server, path, "POST", headers)
        assert code == 403, headers
        status = board.get_status()
        assert status is not None and status.status == TaskState.INIT

    code, body = call(server, path, "POST", {PAGE: "1", "Origin": own_origin})
    assert (code, body["ended"]) == (200, True)
    status = board.get_status()
    assert status is not None and (status.status, status.end_reason) == (TaskState.END, STOP_REASON)
    assert any(e.source == "dashboard" and "stopped from the dashboard" in e.text for e in board.get_events())
    code, body = call(server, path, "POST", {PAGE: "1"})
    assert (code, body["ended"]) == (200, False)  # already ended: nothing changes


def test_host_header_must_name_this_server(server: DashboardServer, board: Board) -> None:
    board.create_task(CONFIG)
    assert call(server, "/api/tasks", headers={"Host": f"localhost:{server.port}"})[0] == 200
    assert call(server, "/api/tasks", headers={"Host": f"rebound.example:{server.port}"})[0] == 403
    assert call(server, "/api/tasks", headers={"Host": f"127.0.0.1:{server.port + 1}"})[0] == 403
    assert call(server, f"/api/task/{board.task_name}", headers={"Host": "rebound.example"})[0] == 403


def test_a_damaged_record_shows_its_error_and_spares_the_other_tasks(
    server: DashboardServer, board: Board, client: redis.Redis
) -> None:
    other = Board(client, board.task_name + "-ok")
    try:
        board.create_task(CONFIG)
        other.create_task(CONFIG)
        client.hset(task_key_prefix(board.task_name) + "task", "actor_num", "lots")
        client.hset(task_key_prefix(other.task_name) + "task", "config", "{not json")
        other.put_stats("actor:0", {"reward": float("nan"), "env_steps_per_s": 10**30, "nested": {"a": [1]},
                                    "uid": "x" * 5000})

        damaged = task_row(server, board.task_name)
        assert damaged["status"] is None and "actor_num" in damaged["error"]
        assert task_row(server, other.task_name)["status"] == "INIT"
        code, task = call(server, f"/api/task/{board.task_name}")
        assert code == 200 and "actor_num" in task["error"]
        code, task = call(server, f"/api/task/{other.task_name}")  # strict JSON: no NaN slipped through
        assert code == 200 and task["error"] is None and "config" in task["config_error"]
        stats = task["actors"][0]["stats"]
        # NaN is no number; a huge int is read as the float field it fills; what no field names and is no
        # number is not shown
        assert (stats["reward"], stats["env_steps_per_s"]) == (None, 1e30) and "nested" not in stats
        assert len(stats["uid"]) <= 300
    finally:
        other.delete_task()


def test_page_is_offline_and_escapes_board_text(server: DashboardServer) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request("GET", "/")
    response = conn.getresponse()
    page = response.read().decode()
    assert response.status == 200 and "script-src 'self'" in response.getheader("Content-Security-Policy", "")
    conn.close()
    static = Path(srl.__file__).parent / "dashboard_static"
    for name in ("index.html", "app.js", "style.css"):
        text = (static / name).read_text()
        assert "http://" not in text and "https://" not in text and "//cdn" not in text, name
    script = (static / "app.js").read_text()
    for sink in (".innerHTML", ".outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert sink not in script, sink  # board text goes in through textContent only
    assert '<script src="/app.js"' in page


def test_cli_takes_the_redis_options_and_its_own() -> None:
    args = build_parser().parse_args(["dashboard", "--url", "redis://h:1/0", "--port", "6380", "--bind", "0.0.0.0",
                                      "--http-port", "0"])
    assert (args.command, args.url, args.port, args.bind, args.http_port) == ("dashboard", "redis://h:1/0", 6380,
                                                                             "0.0.0.0", 0)
    defaults = build_parser().parse_args(["dashboard"])
    assert (defaults.bind, defaults.http_port) == ("127.0.0.1", 8265)


# --------------------------------------------------------------------------- the page in a real browser
def browser_unavailable(why: str) -> None:
    """Skip (locally) or fail (in CI) when the browser test cannot run, as conftest's broker_unavailable."""
    if os.environ.get("CI"):
        pytest.fail(f"CI is set and {why}")
    pytest.skip(why)


def sync_playwright_or_skip() -> Callable[[], Any]:
    if not os.path.exists(CHROMIUM):
        browser_unavailable(f"no chromium at {CHROMIUM}: apt-get install chromium (scripts/setup.sh tries)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        browser_unavailable("the playwright package is missing: pip install -e '.[dev]'")
    return sync_playwright


TRAIN_COUNT = "#detail [data-field=train_count]"


@pytest.mark.slow
def test_live_run_in_a_real_browser(redis_url: str, namespace: str, server: DashboardServer) -> None:
    sync_playwright = sync_playwright_or_skip()
    from playwright.sync_api import expect

    board = board_for(redis_url, namespace)
    client = ClientThread(srl.Runner("CartPole-v1", tiny_config()), RedisParameters(url=redis_url, task_name=namespace),
                          actor_num=1, max_train_count=10**9, local_processes=True, progress_interval=1.0)
    client.start()
    dialogs: list[str] = []
    page_errors: list[str] = []
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM)
            page = browser.new_page(viewport={"width": 1280, "height": 1200})
            page.on("pageerror", lambda error: page_errors.append(str(error)))
            page.goto(f"http://127.0.0.1:{server.port}/#task={namespace}")
            expect(page.locator("#detail-name")).to_have_text(namespace, timeout=30_000)
            expect(page.locator("#detail-status")).to_have_text("ACTIVE", timeout=120_000)

            # the numbers move: the train count shown grows between two reads
            page.wait_for_function(f"() => Number(document.querySelector('{TRAIN_COUNT}').dataset.value) > 0",
                                   timeout=180_000)
            first = int(page.locator(TRAIN_COUNT).get_attribute("data-value") or "0")
            page.wait_for_function(f"(first) => Number(document.querySelector('{TRAIN_COUNT}').dataset.value) > first",
                                   arg=first, timeout=60_000)
            page.wait_for_function("() => Number(document.getElementById('curve').dataset.points) >= 2",
                                   timeout=120_000)
            slots = page.locator("#slots tbody tr")
            expect(slots.nth(0)).to_contain_text("trainer-")
            expect(slots.nth(1)).to_contain_text("actor-")
            expect(slots.nth(1)).to_contain_text("steps/s")
            list_stop = page.locator(f'#tasks tr[data-task="{namespace}"] button.stop')
            expect(list_stop).to_be_visible()

            # board text is hostile: it shows as text, never as markup
            board.log_event("<img src=x onerror=alert(1)> is only text", source="test")
            expect(page.locator("#events")).to_contain_text("<img src=x onerror=alert(1)> is only text")
            assert page.locator("#events img").count() == 0

            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(SCREENSHOT), full_page=True)
            print(f"dashboard screenshot: {SCREENSHOT}")

            def accept(dialog: Any) -> None:
                dialogs.append(dialog.message)
                dialog.accept()

            page.once("dialog", accept)
            page.locator("#detail-stop").click()
            expect(page.locator("#detail-status")).to_have_text("END", timeout=30_000)
            expect(page.locator("#detail [data-field=end_reason]")).to_have_text(STOP_REASON)
            expect(list_stop).to_be_hidden()
            browser.close()

        client.join(90)
        assert not client.is_alive(), "the client thread did not return after the stop"
        assert client.error is None, client.error
        assert len(dialogs) == 1 and namespace in dialogs[0]
        assert page_errors == []
        status = board.get_status()
        assert status is not None and status.status == TaskState.END and "dashboard" in status.end_reason
    finally:
        if client.is_alive():
            board.end_task(TaskState.END, "test over")
            client.join(60)
        board.delete_task()
