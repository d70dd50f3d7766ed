"""Recurrent policies: the state an actor keeps and sends, what a learner rebuilds from it, R2D2's maths."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import srl
from srl.algorithms import impala, ppo, r2d2
from srl.base.env import EnvConfig, env_spec
from srl.base.rollout import Rollout
from srl.base.schema import Schema
from srl.rl.actor_critic import bootstrapped_values, segment_states
from srl.rl.blocks import MLPBlockConfig
from srl.rl.memories import MemoryConfig
from srl.rl.memories.proportional import ProportionalMemory
from srl.runner.distribution.wire.codec import BatchHeader, Codec, DecodeError
from tests.nodes import short_distributed_run

CARTPOLE = "srl/CartPoleNoVel-v1"
PENDULUM = "srl/PendulumNoVel-v1"
CPU = torch.device("cpu")


def small_r2d2(**changes: object) -> r2d2.Config:
    config = r2d2.Config(envs_per_actor=2, sequence_length=8, overlap=4, burn_in=2, n_step=2, batch_size=4,
                         warmup_size=8, env_steps_per_train=4.0, recurrent_size=16, publish_every=5, seed=1,
                         memory=MemoryConfig(capacity=200, alpha=0.9, beta_initial=0.6))
    for name, value in changes.items():
        setattr(config, name, value)
    return config


def rows_of(config: object, env: str, want: int, envs: int = 3) -> tuple[object, dict[str, np.ndarray]]:
    """``want`` rows (or more) a fresh worker of ``config`` makes in ``env``; its parameter."""
    spec = env_spec(EnvConfig(env))
    parameter = config.make_parameter(spec, CPU)  # type: ignore[attr-defined]
    worker = config.make_worker(spec, parameter, 0, 1, 0)  # type: ignore[attr-defined]
    rows: list[dict[str, np.ndarray]] = []
    with Rollout(EnvConfig(env), worker, envs, seed=0) as rollout:
        while sum(len(r["version"]) for r in rows) < want:
            rollout.step()
            taken = worker.take()
            if taken is not None:
                rows.append(taken)
    return parameter, {k: np.concatenate([r[k] for r in rows]) for k in rows[0]}


# ------------------------------------------------------------------ the envs
@pytest.mark.parametrize(("env", "hidden"), [(CARTPOLE, (1, 3)), (PENDULUM, (2,)),
                                           ("srl/AcrobotNoVel-v1", (4, 5))])
def test_the_partially_observed_envs_hide_their_velocities(env: str, hidden: tuple[int, ...]) -> None:
    made = EnvConfig(env).make()
    obs, _ = made.reset(seed=3)
    for _ in range(5):
        obs = made.step(made.action_space.sample())[0]
        assert all(obs[i] == 0.0 for i in hidden)
        assert all(obs[i] != 0.0 for i in range(len(obs)) if i not in hidden)
    made.close()


# ------------------------------------------------------------------ the state in the data
@pytest.mark.parametrize("config", [ppo.Config(recurrent="lstm", envs_per_actor=3, segment_length=8),
                                    small_r2d2(envs_per_actor=3)], ids=["ppo", "r2d2"])
def test_the_state_is_reset_only_for_the_env_whose_episode_starts(config: object) -> None:
    spec = env_spec(EnvConfig(CARTPOLE))
    parameter = config.make_parameter(spec, CPU)  # type: ignore[attr-defined]
    worker = config.make_worker(spec, parameter, 0, 1, 0)  # type: ignore[attr-defined]
    obs = np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32)
    worker.reset(np.arange(3), obs)
    for _ in range(3):
        worker.act(obs)
        worker.observe(np.ones(3, np.float32), obs, np.zeros(3, bool), np.zeros(3, bool))
    before = worker._h.clone()
    assert (before.abs() > 0).all()
    worker.reset(np.array([1]), obs[1:2])
    assert (worker._h[1] == 0).all() and (worker._c[1] == 0).all()
    torch.testing.assert_close(worker._h[[0, 2]], before[[0, 2]])


@pytest.mark.parametrize("algorithm", ["ppo", "impala"])
def test_cell_first_where_it_would_change_nothing_is_refused_with_what_to_do(algorithm: str) -> None:
    """``cell_first=True`` reorders the cells and the MLP over vectors; a config without a cell, or one whose
    observations go through a CNN, is told so instead of training a network that ignores the setting."""
    module = ppo if algorithm == "ppo" else impala
    with pytest.raises(ValueError, match=r"no cell \(recurrent=None\).*recurrent='lstm'"):
        srl.Runner("CartPole-v1", module.Config(cell_first=True))
    pytest.importorskip("ale_py")
    runner = srl.Runner("ALE/Pong-v5", module.Config(recurrent="lstm", cell_first=True))
    with pytest.raises(ValueError, match=r"'ALE/Pong-v5' gets the 'nature_cnn' encoder.*leave cell_first unset"):
        assert runner.spec
    assert srl.Runner(CARTPOLE, module.Config(recurrent="lstm", cell_first=True)).spec.image is False
    assert srl.Runner("ALE/Pong-v5", module.Config(recurrent="lstm")).spec.image  # a preset's value is never refused


@pytest.mark.parametrize(("kind", "cell_first"), [("lstm", False), ("gru", False), ("lstm", True)])
@pytest.mark.parametrize("algorithm", ["ppo", "impala"])
def test_a_learner_unrolling_the_stored_state_reproduces_what_the_actor_computed(algorithm: str, kind: str,
                                                                                cell_first: bool) -> None:
    """The values and log-probabilities the actor recorded step by step come back from one unroll of each
    segment from its stored state, resets inside the segments included; with the cells first as well (they
    read the observations, the hidden layers come after them)."""
    module = ppo if algorithm == "ppo" else impala
    config = module.Config(recurrent=kind, cell_first=cell_first, envs_per_actor=3, segment_length=16, seed=1)
    parameter, rows = rows_of(config, CARTPOLE, 12)
    cell_inputs = {core.rnn.input_size for core in parameter.net.cores}  # type: ignore[attr-defined]
    assert cell_inputs == ({env_spec(EnvConfig(CARTPOLE)).obs_shape[0]} if cell_first else {64})
    assert rows["state_reset"][:, 1:].any(), "no episode ended inside a segment: the test would not see resets"
    h, c, resets = segment_states(rows, CPU)
    assert (c is None) == (kind == "gru")
    net = parameter.net  # type: ignore[attr-defined]
    with torch.no_grad():
        values, _ = bootstrapped_values(net, torch.from_numpy(rows["obs"]), torch.from_numpy(rows["last_obs"]),
                                        h, c, resets)
        logprob, _, _ = net.evaluate_sequence(torch.from_numpy(rows["obs"]), torch.from_numpy(rows["action"]),
                                              h, c, resets)
    np.testing.assert_allclose(values.numpy(), rows["value"], atol=1e-5)
    np.testing.assert_allclose(logprob.numpy(), rows["logprob"], atol=1e-5)
    with torch.no_grad():  # IMPALA's one unroll for both gives the same
        both = net.evaluate_bootstrapped(torch.from_numpy(rows["obs"]), torch.from_numpy(rows["last_obs"]),
                                         torch.from_numpy(rows["action"]), h, c, resets)
        _, last = bootstrapped_values(net, torch.from_numpy(rows["obs"]), torch.from_numpy(rows["last_obs"]),
                                      h, c, resets)
    torch.testing.assert_close(both[0], logprob)
    torch.testing.assert_close(both[2], values)
    torch.testing.assert_close(both[3], last)
    # without the resets the same unroll differs (beyond the match's tolerance, and by orders of magnitude
    # more than the unroll with them): they are what makes it match
    with torch.no_grad():
        ignored = net.sequence_values(torch.from_numpy(rows["obs"]), h, c, torch.zeros_like(resets))
    ignored_error = np.abs(ignored.numpy() - rows["value"]).max()
    matched_error = np.abs(values.numpy() - rows["value"]).max()
    assert ignored_error > 1e-5 and ignored_error > 1000 * max(matched_error, 1e-9)


def test_r2d2_burn_in_from_the_stored_state_reproduces_the_actor_s_state() -> None:
    """Sequences overlap by half: unrolling a sequence's first half from its stored state (its burn-in)
    lands on the state the actor had at the next sequence's start, which that sequence stores."""
    config = small_r2d2(envs_per_actor=2, sequence_length=12, overlap=6, burn_in=6)
    parameter, rows = rows_of(config, CARTPOLE, 10, envs=2)
    q = parameter.q  # type: ignore[attr-defined]
    h, c, resets = segment_states(rows, CPU)
    obs = torch.from_numpy(rows["obs"])
    checked = 0
    with torch.no_grad():
        for row in range(len(rows["version"]) - 2):
            _, h_burnt, c_burnt = q.unroll(obs[row : row + 1, :6], h[row : row + 1], c[row : row + 1],
                                           resets[row : row + 1, :6])
            if rows["state_reset"][row + 2, 0]:
                continue
            torch.testing.assert_close(h_burnt, h[row + 2 : row + 3], atol=1e-6, rtol=0)
            torch.testing.assert_close(c_burnt, c[row + 2 : row + 3], atol=1e-6, rtol=0)
            checked += 1
    assert checked >= 4


def test_r2d2_sequences_overlap_and_carry_each_step_twice() -> None:
    config = small_r2d2(envs_per_actor=2, sequence_length=8, overlap=4)
    _, rows = rows_of(config, CARTPOLE, 6, envs=2)
    # env 0's sequences are rows 0, 2, 4: the second half of one is the first half of the next
    np.testing.assert_array_equal(rows["obs"][0, 4:], rows["obs"][2, :4])
    np.testing.assert_array_equal(rows["action"][2, 4:], rows["action"][4, :4])
    assert config.schema(env_spec(EnvConfig(CARTPOLE))).problem(rows) is None


# ------------------------------------------------------------------ a state the trainer cannot check is refused
@pytest.mark.parametrize(("name", "forge"), [
    ("state_h", lambda a: a[:, :, :-1]),            # wrong shape
    ("state_h", lambda a: np.where(a == a, np.nan, a)),  # not finite
    ("state_h", lambda a: a + 2.0),                  # beyond tanh's range
    ("state_c", lambda a: a * 0 + 1e12),             # huge
])
def test_a_forged_state_column_is_refused(name: str, forge: object) -> None:
    config = ppo.Config(recurrent="lstm", envs_per_actor=2, segment_length=8, seed=1)
    schema: Schema = config.schema(env_spec(EnvConfig(CARTPOLE)))
    _, rows = rows_of(config, CARTPOLE, 2, envs=2)
    assert schema.problem(rows) is None
    codec = Codec(secret="k", task="t")
    forged = {**rows, name: forge(rows[name]).astype(np.float32)}  # type: ignore[operator]
    assert schema.problem(forged) is not None
    with pytest.raises(DecodeError, match=name):
        codec.decode_batch(codec.encode_batch(BatchHeader("a", 0, 1, 0, 1, 2, 1.0), forged, None), schema)


# ------------------------------------------------------------------ R2D2's maths
def test_n_step_targets_stop_at_an_episode_end_and_at_the_sequence_end() -> None:
    reward = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    done = torch.tensor([[False, True, False, False]])
    returns, discount, index = r2d2.n_step_targets(reward, done, 0.5, 2)
    # t0: 1 + .5*2, ends at t1 (done): no bootstrap; t1: 2, done; t2: 3 + .5*4, bootstrap from obs 4 at .25;
    # t3: 4, the sequence ends: bootstrap from obs 4 (last_obs) at .5
    torch.testing.assert_close(returns, torch.tensor([[2.0, 2.0, 5.0, 4.0]]))
    torch.testing.assert_close(discount, torch.tensor([[0.0, 0.0, 0.25, 0.5]]))
    assert index.tolist() == [2, 3, 4, 4]


def test_sequence_priorities_mix_the_max_and_the_mean() -> None:
    td = torch.tensor([[1.0, 3.0], [2.0, 2.0]])
    torch.testing.assert_close(r2d2.sequence_priorities(td, 0.9), torch.tensor([0.9 * 3 + 0.1 * 2, 2.0]))


def test_r2d2_learner_updates_each_sampled_sequence_s_priority() -> None:
    config = small_r2d2()
    runner = srl.Runner(CARTPOLE, config)
    runner.train(max_train_count=3)
    memory = runner._buffer
    assert isinstance(memory, ProportionalMemory)
    tree = memory.tree
    leaves = tree.get(np.arange(len(memory)))
    assert len(set(np.round(leaves, 6))) > 1, "every sequence still has the priority it entered with"
    # what the learner passes: one priority per sampled sequence, at least the mean |TD| of its steps
    calls: list[tuple[np.ndarray, np.ndarray]] = []
    update = memory.update_priorities
    memory.update_priorities = lambda i, p, g=None: (calls.append((i, p)), update(i, p, g))[1]  # type: ignore[method-assign]
    learner = runner._learner
    assert learner is not None
    stats = learner.train()
    assert isinstance(stats, r2d2.R2D2Stats) and len(calls) == 1
    indices, priorities = calls[0]
    assert priorities.shape == (config.batch_size,) and np.mean(priorities) >= stats.td_abs - 1e-6
    np.testing.assert_allclose(tree.get(indices), (priorities + config.memory.priority_epsilon) ** 0.9, rtol=1e-5)


def test_r2d2_rows_carry_no_priorities_and_burn_in_fits_the_overlap() -> None:
    """Its actors send none (new sequences enter at the replay's highest): a batch that brings some is
    refused, so no actor can raise that highest priority for every sequence after it."""
    config = small_r2d2()
    _, rows = rows_of(config, CARTPOLE, 2, envs=2)
    schema = config.schema(env_spec(EnvConfig(CARTPOLE)))
    assert schema.problem(rows) is None
    assert "priorities" in str(schema.problem(rows, np.full(len(rows["version"]), 1e30, np.float32)))
    with pytest.raises(ValueError, match="burn_in"):
        small_r2d2(burn_in=6, overlap=4).validate()


@pytest.mark.parametrize("algorithm", ["ppo", "r2d2"])
def test_a_time_limit_bootstraps_from_the_state_after_the_step(algorithm: str) -> None:
    config = ppo.Config(recurrent="lstm", envs_per_actor=2, segment_length=4) if algorithm == "ppo" else small_r2d2()
    spec = env_spec(EnvConfig(CARTPOLE))
    parameter = config.make_parameter(spec, CPU)
    worker = config.make_worker(spec, parameter, 0, 1, 0)
    rng = np.random.default_rng(0)
    obs, final = (rng.normal(size=(2, 4)).astype(np.float32) for _ in range(2))
    worker.reset(np.arange(2), obs)
    worker.act(obs)
    h, c = worker._h.clone(), worker._c.clone()
    worker.observe(np.zeros(2, np.float32), final, np.zeros(2, bool), np.array([True, False]))
    with torch.no_grad():
        if algorithm == "ppo":
            value = parameter.net.step_outputs(torch.from_numpy(final[:1]), h[:1], c[:1])[1]
            recorded, gamma = worker._bootstrap[0], worker.gamma
        else:
            value = r2d2.unrescale(parameter.q.step(torch.from_numpy(final[:1]), h[:1], c[:1])[0].max(dim=1).values)
            recorded, gamma = worker._ring["reward"][0], config.gamma
    assert recorded[0] == pytest.approx(gamma * float(value[0]), rel=1e-5)
    assert recorded[1] == 0.0


@pytest.mark.parametrize("algorithm", ["ppo", "impala", "r2d2"])
def test_evaluating_fewer_episodes_than_an_actor_has_envs_keeps_one_state_per_env_run(algorithm: str) -> None:
    # evaluate steps min(envs_per_actor, max_episodes) envs: the worker's states must be as many
    config = {
        "ppo": ppo.Config(recurrent="lstm", envs_per_actor=4, segment_length=8, epochs=1, seed=1),
        "impala": impala.Config(recurrent="gru", envs_per_actor=4, segment_length=8, batch_segments=2, seed=1),
        "r2d2": small_r2d2(envs_per_actor=4),
    }[algorithm]
    scores = srl.Runner(CARTPOLE, config).evaluate(max_episodes=3, seed=7)
    assert len(scores) == 3
    assert all(score >= 1.0 for score in scores)


# ------------------------------------------------------------------ one process: learn, save, resume
@pytest.mark.parametrize("algorithm", ["ppo", "appo", "impala", "r2d2"])
def test_a_recurrent_checkpoint_restores_and_resumes(algorithm: str, tmp_path: Path) -> None:
    config = {
        "ppo": ppo.Config(recurrent="lstm", envs_per_actor=2, segment_length=16, epochs=2, seed=1),
        "appo": ppo.Config(recurrent="gru", sync=False, envs_per_actor=2, segment_length=16, epochs=2, seed=1),
        "impala": impala.Config(recurrent="gru", envs_per_actor=2, segment_length=8, batch_segments=2, seed=1),
        "r2d2": small_r2d2(),
    }[algorithm]
    runner = srl.Runner(CARTPOLE, config)
    runner.train(max_steps=600)
    scores = runner.evaluate(max_episodes=2, seed=7)
    runner.save(tmp_path / "r.safetensors")
    again = srl.Runner.from_checkpoint(tmp_path / "r.safetensors")
    assert again.rl_config == runner.rl_config
    assert again.evaluate(max_episodes=2, seed=7) == scores
    count = again.train_count
    again.train(max_steps=300)
    assert again.train_count > count


@pytest.mark.parametrize("algorithm", ["ppo", "impala"])
def test_a_checkpoint_made_under_another_network_is_refused_naming_the_setting(algorithm: str,
                                                                                tmp_path: Path) -> None:
    """A recurrent Discrete checkpoint made with the layer before the cells (the network before the preset
    changed) loaded into a config left to today's preset: refused before any weight is touched, naming the
    setting, whose value each side resolves to and what to do; loaded where the settings match (set, or
    left to the same preset), it is the same policy."""
    module = {"ppo": ppo, "impala": impala}[algorithm]
    old = module.Config(recurrent="lstm", envs_per_actor=2, seed=1, cell_first=False, normalize_obs=False,
                        hidden_block=MLPBlockConfig((64, 64), "tanh"))
    runner = srl.Runner(CARTPOLE, old)
    runner.save(tmp_path / "old.safetensors")
    today = srl.Runner(CARTPOLE, module.Config(recurrent="lstm"))
    before = today.parameter.to_arrays()
    with pytest.raises(ValueError, match=r"was trained with cell_first=False, this config has cell_first=True \(as "
                                         r"the presets resolve for this env\).*Set cell_first as the checkpoint"):
        today.load(tmp_path / "old.safetensors")
    assert all(np.array_equal(v, before[k]) for k, v in today.parameter.to_arrays().items())
    same = srl.Runner(CARTPOLE, module.Config(recurrent="lstm", cell_first=False, normalize_obs=False,
                                              hidden_block=MLPBlockConfig((64, 64), "tanh")))
    same.load(tmp_path / "old.safetensors")
    assert same.evaluate(max_episodes=2, seed=7) == runner.evaluate(max_episodes=2, seed=7)
    srl.Runner(CARTPOLE, module.Config(recurrent="lstm", seed=1)).save(tmp_path / "preset.safetensors")
    srl.Runner(CARTPOLE, module.Config(recurrent="lstm")).load(tmp_path / "preset.safetensors")


# ------------------------------------------------------------------ distributed
def recurrent_configs() -> dict[str, object]:
    return {
        "r2d2": small_r2d2(),
        "ppo": ppo.Config(recurrent="lstm", envs_per_actor=2, segment_length=8, epochs=1, seed=1),
        "impala": impala.Config(recurrent="lstm", envs_per_actor=2, segment_length=8, batch_segments=2,
                                buffer_segments=8, seed=1),
    }


@pytest.mark.slow
@pytest.mark.parametrize(("algorithm", "queue"), [("r2d2", "redis"), ("r2d2", "rabbitmq"), ("ppo", "redis"),
                                                ("impala", "redis")])
def test_a_short_distributed_recurrent_run_ends_with_an_evaluation(
    algorithm: str, queue: str, redis_url: str, namespace: str
) -> None:
    queue_params = None
    if queue == "rabbitmq":
        from srl.runner.distribution import RabbitMQParameters
        from tests.test_queues import _rabbitmq

        queue_params = RabbitMQParameters(url=_rabbitmq().url)
    runner = srl.Runner(CARTPOLE, recurrent_configs()[algorithm])  # type: ignore[arg-type]
    short_distributed_run(runner, redis_url, namespace, 20, queue_params)


# ------------------------------------------------------------------ frames once, for sequences
def stacked_stream(length: int, starts: set[int], stack: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """Stacks ``(length + 1, stack, 2, 2)`` of a stream of distinct frames whose episodes begin at ``starts``
    (a reset stack is copies of its frame, as gymnasium's FrameStackObservation pads), and the start flags."""
    frames = np.arange((length + 1) * 4, dtype=np.uint8).reshape(length + 1, 2, 2)
    stacks = np.zeros((length + 1, stack, 2, 2), np.uint8)
    begin = 0
    for t in range(length + 1):
        if t in starts:
            begin = t
        stacks[t] = frames[[max(begin, t - k) for k in reversed(range(stack))]]
    flags = np.array([t in starts for t in range(length)])
    return stacks, flags


def test_a_sequence_of_frames_gives_back_the_stacks_it_was_made_from() -> None:
    from srl.rl.actor_critic import segment_observations

    stacks, flags = stacked_stream(12, {0, 5, 6})
    obs, last = stacks[None, :12], stacks[None, 12]
    frames, first = r2d2.sequence_frames(obs, last, flags[None])
    assert frames.shape == (1, 12 + 4, 2, 2)  # each frame once, not 4 per step
    rebuilt, rebuilt_last = segment_observations({"frames": frames, "first": first}, 4)
    np.testing.assert_array_equal(rebuilt, obs)
    np.testing.assert_array_equal(rebuilt_last, last)


def test_an_actor_s_allowance_covers_the_steps_before_its_first_sequences() -> None:
    path = small_r2d2().data_path()
    assert path.row_steps == 4 and path.row_lead == 4
    # the warmup's 8 rows from 2 envs need 8 steps for the first 2 rows, then 4 per 2 rows: 2 * 8 + 3 * 2 * 4
    needed = 2 * 8 + 3 * 2 * 4
    assert path.env_steps_allowed(0) + path.first_rows_steps(2) >= needed
    assert dqn_path_unchanged()


def dqn_path_unchanged() -> bool:
    from srl.algorithms import dqn

    path = dqn.Config().data_path()
    return path.first_rows_steps(8) == 0 and path.env_steps_allowed(10) == path.warmup_rows + 10.0


# ------------------------------------------------------------------ R2D2's presets and budget
def test_r2d2_as_it_comes_takes_its_family_preset_and_a_field_set_wins(caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("minatar")
    with caplog.at_level("INFO", logger="srl.r2d2"):
        vectors = r2d2.Config().settled(EnvConfig("CartPole-v1"))
    assert vectors.lr == r2d2.PRESETS["lr"][r2d2.FAMILIES.index("vectors")]
    assert "vectors preset" in caplog.text and "lr 0.001" in caplog.text
    assert vectors.apex_epsilon == 0.6 and "apex_epsilon 0.6" in caplog.text
    grids = r2d2.Config().settled(EnvConfig("MinAtar/Breakout-v1"))
    assert grids.lr == r2d2.PRESETS["lr"][r2d2.FAMILIES.index("grids")]
    assert grids.apex_epsilon == 0.4  # Ape-X's, as for images
    assert r2d2.Config(lr=3e-3).settled(EnvConfig("CartPole-v1")).lr == 3e-3
    assert r2d2.Config(apex_epsilon=0.3).settled(EnvConfig("CartPole-v1")).apex_epsilon == 0.3
    config = r2d2.Config()
    config.settled(EnvConfig("CartPole-v1"))
    assert config.lr is None and config.apex_epsilon is None  # settled is a copy: one config serves several envs


def test_r2d2_workers_explore_with_their_familys_apex_epsilon_unsettled_or_not() -> None:
    """A worker made from a config left at its presets explores with its env's family's ε (one process, a
    hand-started actor and a server all make theirs from the spec); a config not resolved says what to do."""
    spec = env_spec(EnvConfig(CARTPOLE))
    config = r2d2.Config(envs_per_actor=2)
    worker = config.make_worker(spec, config.make_parameter(spec, CPU), 0, 1, 0)
    np.testing.assert_allclose(worker.epsilon, [0.6, 0.6**8])
    with pytest.raises(ValueError, match="apex_epsilon is None"):
        config.actor_epsilon(0, 1)


@pytest.mark.parametrize(("max_steps", "max_train_count", "period"), [
    (300_000, None, 375),        # 7,500 planned train steps (40 env steps each) / 20 copies
    (None, 100_000, 2500),       # the paper's period at most
    (2_000, None, 100),          # at least 100
    (None, None, 2500),          # no planned end: the paper's
])
def test_r2d2_derives_its_target_period_from_the_budget(max_steps: int | None, max_train_count: int | None,
                                                        period: int) -> None:
    config = small_r2d2(env_steps_per_train=40.0)
    assert config.budget_settings(max_steps, max_train_count) == {"target_update_interval": period}
    spec = env_spec(EnvConfig(CARTPOLE))
    parameter = config.make_parameter(spec, CPU)
    learner = config.make_learner(spec, parameter, config.make_buffer(spec))
    learner.plan(max_steps, max_train_count)
    assert learner.target_period == period  # type: ignore[attr-defined]
    assert small_r2d2(target_update_interval=7).budget_settings(max_steps, max_train_count) == {}


def test_a_run_says_the_settings_it_derived_from_its_budget(caplog: pytest.LogCaptureFixture) -> None:
    runner = srl.Runner(CARTPOLE, small_r2d2(env_steps_per_train=40.0))
    with caplog.at_level("INFO", logger="srl.runner"):
        runner.train(max_steps=400, progress_interval=None)
    assert "derived from the run's budget: target_update_interval 100" in caplog.text
