"""Operating srl: what an operator meets running it for a week (help, typos, bad input, bad
credentials, replaced and re-attached tasks, refusals, counters that reconcile)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from srl.cli import build_parser

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
    ({"queue_capacity": 8, "rl_lr": "0.001"}, ValueError, r"lr must be a finite number in \(0, 1\], got '0\.001' "
                                                          r"\(a str\)"),
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


def test_bad_arguments_on_an_embedded_redis_start_nothing() -> None:
    import srl
    from srl.runner.distribution import RedisParameters
    from tests.nodes import tiny_config

    runner = srl.Runner("Pendulum-v1", tiny_config())
    with pytest.raises(TypeError, match=r"actor_num must be an integer in 1\.\.100000, got 1\.5 \(a float\)"):
        runner.train_distribution(RedisParameters(), actor_num=1.5, max_train_count=10)  # type: ignore[arg-type]
