"""What a run leaves behind: history, evaluations, TensorBoard events, checkpoints, resume (one process and
distributed), and a forged checkpoint on the board."""

from __future__ import annotations

import csv
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import srl
from srl.algorithms import dqn, impala, ppo
from srl.base.arrays import load_arrays, save_arrays
from srl.runner.distribution import RedisParameters
from srl.runner.distribution.board.board import TaskState
from srl.runner.distribution.client.evaluator import Evaluator
from srl.runner.distribution.wire.codec import Codec
from srl.runner.run_log import CsvLog, RunLog, latest_checkpoint, write_checkpoint
from tests.nodes import Node, board_for, kill_all, tiny_config, wait_for


def rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_csv_log_widens_its_header_when_a_column_appears(tmp_path: Path) -> None:
    log = CsvLog(tmp_path / "h.csv")
    log.append({"a": 1})
    log.append({"a": 2, "b": 3.5})
    assert rows(tmp_path / "h.csv") == [{"a": "1", "b": ""}, {"a": "2", "b": "3.5"}]
    again = CsvLog(tmp_path / "h.csv")  # a resumed run goes on in the same file
    again.append({"b": 4})
    assert [r["b"] for r in rows(tmp_path / "h.csv")] == ["", "3.5", "4"]
    assert again.last("a") == 2.0


def test_one_process_run_leaves_history_evals_tensorboard_and_checkpoints(tmp_path: Path) -> None:
    runner = srl.Runner("CartPole-v1", ppo.Config(seed=0, envs_per_actor=4, segment_length=16))
    runner.train(max_steps=4 * 16 * 12, progress_interval=0.01, log_dir=tmp_path, eval_every=4, eval_episodes=2,
                 checkpoint_interval=0.01, keep_checkpoints=2)
    history = rows(tmp_path / "history.csv")
    assert len(history) >= 2
    last = history[-1]
    assert int(last["train_count"]) == runner.train_count and int(last["env_steps"]) == runner.env_steps
    for column in ("reward_mean", "loss", "policy_loss", "approx_kl", "env_steps_per_s", "train_per_s", "wall_s"):
        assert column in last, column
    evals = rows(tmp_path / "eval.csv")
    assert len(evals) >= 2 and all(float(r["eval_mean"]) > 0 for r in evals)
    assert [int(r["train_count"]) for r in evals] == sorted(int(r["train_count"]) for r in evals)
    checkpoints = sorted((tmp_path / "checkpoints").glob("ckpt-*.safetensors"))
    assert len(checkpoints) == 2  # the newest two kept
    assert latest_checkpoint(tmp_path) == checkpoints[-1]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert "train/loss" in tags and "rollout/reward_mean" in tags and "eval/eval_mean" in tags
    assert [e.step for e in events.Scalars("eval/eval_mean")] == [int(r["env_steps"]) for r in evals]


def test_a_new_run_in_the_same_log_dir_keeps_its_checkpoints_and_resume_takes_them(tmp_path: Path) -> None:
    earlier = srl.Runner("CartPole-v1", ppo.Config(seed=0, envs_per_actor=4, segment_length=16))
    earlier.train(max_steps=4 * 16 * 8, progress_interval=None, log_dir=tmp_path, checkpoint_interval=0.01,
                  keep_checkpoints=2)
    kept = sorted((tmp_path / "checkpoints").glob("ckpt-*.safetensors"))
    assert len(kept) == 2
    an_hour_ago = time.time() - 3600  # the earlier run's files were written then
    for path in kept:
        os.utime(path, (an_hour_ago, an_hour_ago))
    # a new run (not resumed) of the same task, in the same directory: its train count starts below those
    later = srl.Runner("CartPole-v1", ppo.Config(seed=1, envs_per_actor=4, segment_length=16))
    later.train(max_steps=4 * 16 * 2, progress_interval=None, log_dir=tmp_path, checkpoint_interval=600.0,
                keep_checkpoints=2)
    assert 0 < later.train_count < earlier.train_count
    own = tmp_path / "checkpoints" / f"ckpt-{later.train_count:010d}.safetensors"
    assert own.exists(), f"the new run's checkpoint was pruned: {sorted(p.name for p in kept)}"
    newest = latest_checkpoint(tmp_path)
    assert newest == own, newest
    assert srl.Runner.from_checkpoint(newest).train_count == later.train_count
    # the oldest of the earlier run's went to make room; its newest stays until the new run has two
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("ckpt-*")) == sorted([kept[-1].name, own.name])


def test_checkpoints_are_pruned_by_when_they_were_written_not_by_their_train_count(tmp_path: Path) -> None:
    directory = tmp_path / "checkpoints" / "srl"
    arrays = {"w": np.zeros(3, np.float32)}
    an_hour_ago = time.time() - 3600
    for i, count in enumerate((3000, 4000, 5000)):  # an earlier run of the task "srl"
        path = write_checkpoint(directory, count, arrays, {"train_count": count}, keep=3)
        os.utime(path, (an_hour_ago + i, an_hour_ago + i))
    first = write_checkpoint(directory, 100, arrays, {"train_count": 100}, keep=3)
    assert first.exists() and latest_checkpoint(tmp_path) == first
    second = write_checkpoint(directory, 200, arrays, {"train_count": 200}, keep=3)
    assert latest_checkpoint(tmp_path) == second
    assert sorted(p.name for p in directory.glob("ckpt-*")) == [
        "ckpt-0000000100.safetensors", "ckpt-0000000200.safetensors", "ckpt-0000005000.safetensors"]
    # within one run (the same second on a coarse clock) the train count decides
    for path in directory.glob("ckpt-*"):
        os.utime(path, (an_hour_ago, an_hour_ago))
    assert latest_checkpoint(tmp_path) == directory / "ckpt-0000005000.safetensors"


@pytest.mark.parametrize("make_config", [
    lambda: tiny_config(warmup_size=64),
    lambda: ppo.Config(seed=0, envs_per_actor=2, segment_length=16, normalize_reward=True),
    lambda: impala.Config(seed=0, envs_per_actor=2, segment_length=8, batch_segments=2),
], ids=["dqn", "ppo", "impala"])
def test_checkpoint_restores_weights_optimizer_and_counters(tmp_path: Path, make_config) -> None:  # type: ignore[no-untyped-def]
    runner = srl.Runner("CartPole-v1", make_config())
    runner.train(max_steps=400, progress_interval=None)
    assert runner._learner is not None and runner.train_count > 0
    path = tmp_path / "ckpt.safetensors"
    runner.save(path)

    again = srl.Runner.from_checkpoint(path)
    assert (again.train_count, again.env_steps, again.episodes) == (runner.train_count, runner.env_steps,
                                                                    runner.episodes)
    again.train(max_steps=1, progress_interval=None)  # builds the trainer, which takes the saved state
    saved, loaded = runner._learner.state_arrays(), again._learner.state_arrays()  # type: ignore[union-attr]
    assert saved[0].keys() == loaded[0].keys() and any(k.startswith("optimizer/") for k in saved[0])
    for key, value in saved[0].items():
        np.testing.assert_array_equal(value, loaded[0][key], err_msg=key)
    assert saved[1]["optimizer"]["param_groups"][0]["lr"] == loaded[1]["optimizer"]["param_groups"][0]["lr"]


def test_a_checkpoint_for_another_network_is_refused_with_the_reason(tmp_path: Path) -> None:
    runner = srl.Runner("CartPole-v1", tiny_config(warmup_size=64))
    runner.train(max_steps=200, progress_interval=None)
    path = tmp_path / "ckpt.safetensors"
    runner.save(path)
    meta, arrays = load_arrays(path)
    key = next(k for k in arrays if k.startswith("trainer/optimizer/"))
    arrays[key] = np.zeros((3, 3), np.float32)
    save_arrays(tmp_path / "bad.safetensors", arrays, meta)
    other = srl.Runner.from_checkpoint(tmp_path / "bad.safetensors")
    with pytest.raises(ValueError, match="optimizer entry"):
        other.train(max_steps=1, progress_interval=None)
    with pytest.raises(ValueError, match="holds 'dqn' weights; this task is 'ppo'"):
        srl.Runner("CartPole-v1", ppo.Config()).load(path)


def test_a_checkpoint_from_before_scale_obs_loads_as_it_was_trained(tmp_path: Path) -> None:
    runner = srl.Runner("Pendulum-v1", tiny_config(warmup_size=64, scale_obs=False))
    runner.train(max_steps=200, progress_interval=None)
    path = tmp_path / "ckpt.safetensors"
    runner.save(path)
    meta, arrays = load_arrays(path)
    del meta["rl_config"]["scale_obs"]  # as written before the setting existed: raw observations
    save_arrays(tmp_path / "old.safetensors", arrays, meta)
    old = srl.Runner.from_checkpoint(tmp_path / "old.safetensors")
    assert old.rl_config.scale_obs is False  # type: ignore[attr-defined]
    np.testing.assert_allclose(old.evaluate(2, seed=5), runner.evaluate(2, seed=5))
    with pytest.raises(ValueError, match="trained with scale_obs=False, this config has scale_obs=True"):
        srl.Runner("Pendulum-v1", tiny_config(warmup_size=64, scale_obs=True)).load(tmp_path / "old.safetensors")
    srl.Runner("Pendulum-v1", tiny_config(warmup_size=64, scale_obs=False)).load(tmp_path / "old.safetensors")


def test_the_final_evaluation_row_is_written_even_when_those_params_were_evaluated_already(
        redis_url: str, namespace: str, tmp_path: Path) -> None:
    board = board_for(redis_url, namespace)
    board.create_task('{"algorithm": "dqn"}', actor_num=1)
    epoch = board.claim_trainer("t", 10_000)
    assert epoch is not None
    runner = srl.Runner("CartPole-v1", tiny_config())
    codec = Codec(task=namespace)
    blob = codec.encode_params(runner.parameter.to_arrays(), {"epoch": epoch, "version": 3, "train_count": 30})
    assert board.publish_params("t", epoch, 3, blob, 30)
    run_log = RunLog(tmp_path)
    evaluator = Evaluator(runner, board, codec, None, 10, 2, run_log)
    periodic = evaluator.evaluate_now()  # the periodic evaluation got to the last params first
    assert periodic is not None and periodic["version"] == 3
    assert evaluator.evaluate_now() is None  # the same params are not evaluated twice
    final = evaluator.evaluate_now(final=True)
    run_log.close()
    assert final is not None and final["final"] == 1 and final["eval_mean"] == periodic["eval_mean"]
    evals = rows(tmp_path / "eval.csv")
    assert [e.get("final") for e in evals] == ["", "1"] and evals[-1]["version"] == "3"
    board.delete_task()


@pytest.mark.slow
def test_distributed_run_logs_evaluates_checkpoints_and_resumes(redis_url: str, namespace: str,
                                                                tmp_path: Path) -> None:
    params = RedisParameters(url=redis_url, task_name=namespace)
    runner = srl.Runner("CartPole-v1", tiny_config(warmup_size=100))
    fast = {"heartbeat_interval": 0.2}
    # long enough for the evaluator (it looks at the train count every 0.5 s) to see a multiple of 300
    # pass: 1,000 train steps once took under a second and only the final evaluation was written
    runner.train_distribution(params, actor_num=1, max_train_count=3000, progress_interval=0.3, local_processes=True,
                              log_dir=tmp_path, eval_every=300, eval_episodes=2, checkpoint_interval=0.5,
                              overwrite=True, trainer_options=fast, actor_options=fast)
    history = rows(tmp_path / "history.csv")
    assert history and int(history[-1]["train_count"]) > 0
    assert {"reward_mean", "loss", "train_per_s", "actor0_env_steps_per_s", "queue_in_flight"} <= history[-1].keys()
    evals = rows(tmp_path / "eval.csv")
    assert len(evals) >= 2 and evals[-1].get("final") == "1"
    assert int(evals[-1]["train_count"]) == 3000
    board = board_for(redis_url, namespace)
    on_board = board.get_history()
    assert on_board and on_board[-1]["train_count"] == int(history[-1]["train_count"])
    checkpoint = latest_checkpoint(tmp_path)
    assert checkpoint is not None and checkpoint.parent == tmp_path / "checkpoints" / namespace
    meta, arrays = load_arrays(checkpoint)
    assert meta["train_count"] == 3000 and any(k.startswith("trainer/optimizer/") for k in arrays)
    assert (tmp_path / "final.safetensors").exists()

    resumed = srl.Runner("CartPole-v1", tiny_config(warmup_size=100))
    resumed.train_distribution(params, actor_num=1, max_train_count=200, progress_interval=None,
                               local_processes=True, log_dir=tmp_path, resume_from=tmp_path, overwrite=True)
    assert resumed.train_count == 3200  # the budget counts from the checkpoint
    more = rows(tmp_path / "history.csv")
    assert len(more) > len(history) and float(more[-1]["wall_s"]) > float(history[-1]["wall_s"])
    assert any(e.text.startswith("trainer") for e in board.get_events(50))


@pytest.mark.slow
def test_a_forged_checkpoint_on_the_board_fails_the_task_not_the_trainer(redis_url: str, namespace: str,
                                                                        tmp_path: Path) -> None:
    board = board_for(redis_url, namespace)
    config = srl.Runner("CartPole-v1", tiny_config()).task_config()
    board.create_task({**config, "actor_num": 1, "max_train_count": 10})
    board.set_resume(b"SRL1" + b"\x00" * 64)  # what anyone with write access to Redis could put there
    board.set_active()
    node = Node("trainer", redis_url, namespace, tmp_path)
    try:
        status = wait_for(lambda: (s := board.get_status()) and s.status == TaskState.FAILED and s, 30, "FAILED")
        assert "checkpoint to resume from does not fit this task" in status.end_reason
        assert node.alive()  # it waits for the next task
    finally:
        kill_all([node])


def test_srl_plot_writes_pngs_of_a_run_and_says_what_is_missing(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    from srl.cli import main

    runner = srl.Runner("CartPole-v1", ppo.Config(seed=0, envs_per_actor=2, segment_length=16))
    runner.train(max_steps=2 * 16 * 6, progress_interval=0.01, log_dir=tmp_path / "run", eval_every=2,
                 eval_episodes=1, checkpoint_interval=None)
    assert main(["plot", str(tmp_path / "run")]) == 0
    for name in ("reward.png", "loss.png", "throughput.png"):
        data = (tmp_path / "run" / name).read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 5000, name
    assert runner.plot(tmp_path / "run")[0] == tmp_path / "run" / "reward.png"
    assert main(["plot", str(tmp_path / "nothing")]) == 2
    assert "history.csv is missing or empty" in capsys.readouterr().err


def test_the_greedy_average_survives_a_checkpoint_and_starts_at_the_online_net_without_one(tmp_path: Path) -> None:
    runner = srl.Runner("Pendulum-v1", tiny_config(warmup_size=64, greedy_average_tau=0.05))
    runner.train(max_train_count=50, progress_interval=None)
    path = tmp_path / "ckpt.safetensors"
    runner.save(path)
    again = srl.Runner.from_checkpoint(path)
    np.testing.assert_allclose(again.evaluate(2, seed=5), runner.evaluate(2, seed=5))
    meta, arrays = load_arrays(path)
    for key in [k for k in arrays if k.startswith("q_average.")]:
        del arrays[key]
    del meta["rl_config"]["greedy_average_tau"]  # as written before the setting existed: no average
    save_arrays(tmp_path / "old.safetensors", arrays, meta)
    old = srl.Runner.from_checkpoint(tmp_path / "old.safetensors")
    assert old.rl_config.greedy_average_tau == 0.0  # type: ignore[attr-defined]
    into_new = srl.Runner("Pendulum-v1", tiny_config(warmup_size=64, greedy_average_tau=0.05))
    into_new.load(tmp_path / "old.safetensors")  # the average starts at the saved online weights
    parameter = into_new.parameter
    assert isinstance(parameter, dqn.DQNParameter) and parameter.q_average is not None
    for a, q in zip(parameter.q_average.parameters(), parameter.q.parameters(), strict=True):
        torch.testing.assert_close(a, q)
    np.testing.assert_allclose(into_new.evaluate(2, seed=5), old.evaluate(2, seed=5))
