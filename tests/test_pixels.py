"""Pixels: image observations kept as they are, encoders, the Atari and MinAtar envs, images on the wire."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard
from torch import nn

import srl
from srl.algorithms import dqn, impala, ppo
from srl.base.env import EnvConfig, EnvError, EnvSpec, env_spec
from srl.base.rl import Worker
from srl.base.rollout import Rollout
from srl.base.schema import Column, Schema
from srl.rl.actor_critic import segment_observations
from srl.rl.memories import MemoryConfig
from srl.rl.memories.frames import FrameMemory, check_stacks, stacks_of
from srl.rl.networks import EncoderConfig, EncoderError
from srl.runner.distribution import RedisParameters
from srl.runner.distribution.settings.task import TaskConfigError, build_task
from srl.runner.distribution.wire.codec import FLAG_ZSTD, MAGIC, WIRE_VERSION, BatchHeader, Codec, DecodeError
from tests.nodes import short_distributed_run

PONG = "ALE/Pong-v5"
BREAKOUT = "ALE/Breakout-v5"
MINATAR = "MinAtar/Breakout-v1"


class TinyEncoder(nn.Module):
    """A user's own encoder: it gets observations as the env gives them (here bool grids)."""

    def __init__(self, spec: EnvSpec) -> None:
        super().__init__()
        self.linear = nn.Linear(int(np.prod(spec.obs_shape)), 8)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(obs.flatten(1).float()))


def tiny_encoder(spec: EnvSpec) -> nn.Module:
    """``tests.test_pixels:tiny_encoder``"""
    return TinyEncoder(spec)


def small_dqn(**changes: object) -> dqn.Config:
    config = dqn.Config(batch_size=16, warmup_size=64, seed=1, memory=MemoryConfig(kind="replay", capacity=2000))
    for name, value in changes.items():
        setattr(config, name, value)
    if "epsilon" in changes:  # every env explores at that ε, not at Ape-X's schedule over the envs
        config.apex_epsilon, config.apex_alpha = float(changes["epsilon"]), 0.0  # type: ignore[arg-type]
    return config


# ------------------------------------------------------------------ observations keep dtype and shape
def test_images_keep_their_dtype_and_shape_and_vectors_stay_flat_float32() -> None:
    pong, minatar, cartpole = (env_spec(EnvConfig(i)) for i in (PONG, MINATAR, "CartPole-v1"))
    assert (pong.obs_dtype, pong.obs_shape, pong.image) == ("uint8", (4, 84, 84), True)
    assert (minatar.obs_dtype, minatar.obs_shape) == ("bool", (4, 10, 10))  # channels first after "minatar"
    assert (cartpole.obs_dtype, cartpole.obs_shape, cartpole.image) == ("float32", (4,), False)
    assert pong.obs_column() == Column("uint8", (4, 84, 84), 0, 255)
    assert minatar.obs_column(16) == Column("bool", (16, 4, 10, 10))
    assert dqn.Config(store_frames_once=False).schema(pong).columns["obs"].row_nbytes == 4 * 84 * 84  # a byte a pixel
    assert dqn.Config().schema(pong).columns["frame"].row_nbytes == 84 * 84  # and each frame once


def test_the_atari_preprocessing_is_the_default_for_ale_ids_and_can_be_turned_off() -> None:
    assert EnvConfig(PONG).resolved_preprocessing() == "atari"
    assert EnvConfig(MINATAR).resolved_preprocessing() == "minatar"
    assert EnvConfig("CartPole-v1").resolved_preprocessing() == "none"
    raw = env_spec(EnvConfig(PONG, preprocessing="none"))
    assert (raw.obs_dtype, raw.obs_shape) == ("uint8", (210, 160, 3))
    env = EnvConfig(PONG).make()
    try:
        obs, _ = env.reset(seed=0)
        first = np.asarray(obs)
        obs, *_ = env.step(0)
        # the stack moves by one frame a step: the newest three frames before are the oldest three now
        np.testing.assert_array_equal(np.asarray(obs)[:3], first[1:])
    finally:
        env.close()
    assert EnvConfig.from_dict(EnvConfig(PONG, preprocessing="none").to_dict()) == EnvConfig(PONG, preprocessing="none")


def test_an_unknown_preprocessing_is_refused_before_anything_starts_with_the_closest_name() -> None:
    with pytest.raises(EnvError, match=r"preprocessing 'atary' is not one of .*did you mean 'atari'"):
        EnvConfig(PONG, preprocessing="atary")
    with pytest.raises(EnvError, match="preprocessing 'atary'"):
        srl.Runner(EnvConfig(PONG, preprocessing="atary"), small_dqn())
    # the same name read from a board is refused as a task no node can build (never imported, never a wrapper)
    task = srl.Runner(MINATAR, small_dqn()).task_config()
    task["env"]["preprocessing"] = "atary"
    with pytest.raises(TaskConfigError, match="atary"):
        build_task(json.dumps(task))
    with pytest.raises(EnvError, match="frameskip=4 would skip again"):
        EnvConfig(PONG, frameskip=4).make()


class Recorder(Worker):
    """Acts at random and keeps what ``observe`` was told."""

    def __init__(self, n_actions: int) -> None:
        self.rng = np.random.default_rng(0)
        self.n_actions = n_actions
        self.rewards: list[float] = []
        self.terminated: list[bool] = []

    def act(self, obs: np.ndarray) -> np.ndarray:
        return self.rng.integers(self.n_actions, size=len(obs))

    def observe(self, reward: np.ndarray, next_obs: np.ndarray, terminated: np.ndarray, truncated: np.ndarray) -> None:
        self.rewards.append(float(reward[0]))
        self.terminated.append(bool(terminated[0]))

    def pending(self) -> int:
        return 0

    def take(self) -> None:
        return None


@pytest.mark.slow
def test_a_training_worker_sees_clipped_rewards_and_lost_lives_while_episodes_count_full_games() -> None:
    worker = Recorder(4)
    with Rollout(EnvConfig(BREAKOUT), worker, num_envs=1, seed=3) as rollout:
        episodes = []
        while not episodes:
            episodes = rollout.step()
    rewards, ends = np.array(worker.rewards), np.array(worker.terminated)
    assert set(np.unique(rewards)) <= {0.0, 1.0}
    # Breakout has 5 lives: the worker saw 5 terminal steps in one game, the episode counts one
    assert ends.sum() == 5 and ends[-1]
    assert len(episodes) == 1 and episodes[0].length == len(rewards)
    assert episodes[0].total_reward >= rewards.sum()  # unclipped (bricks of higher rows are worth 4 and 7)
    # evaluating (training False) sees the env's own signal: one terminal step at game over
    watcher = Recorder(4)
    watcher.training = False
    with Rollout(EnvConfig(BREAKOUT), watcher, num_envs=1, seed=3) as rollout:
        while not rollout.step():
            pass
    assert sum(watcher.terminated) == 1


# ------------------------------------------------------------------ ale-py's vector env
class Steps(Worker):
    """Acts at random in E envs and keeps what it is told, env by env."""

    def __init__(self, num_envs: int, n_actions: int, training: bool = False) -> None:
        self.num_envs, self.training = num_envs, training
        self.rng = np.random.default_rng(0)
        self.n_actions = n_actions
        self.rewards: list[list[float]] = [[] for _ in range(num_envs)]
        self.terminated: list[list[bool]] = [[] for _ in range(num_envs)]
        self.resets: list[tuple[list[int], np.ndarray]] = []
        self.acted: list[np.ndarray] = []
        self.next: list[np.ndarray] = []

    def reset(self, env_ids: np.ndarray, obs: np.ndarray) -> None:
        self.resets.append(([int(i) for i in env_ids], obs.copy()))

    def act(self, obs: np.ndarray) -> np.ndarray:
        self.acted.append(obs.copy())
        return self.rng.integers(self.n_actions, size=len(obs))

    def observe(self, reward: np.ndarray, next_obs: np.ndarray, terminated: np.ndarray, truncated: np.ndarray) -> None:
        self.next.append(next_obs.copy())
        for i in range(self.num_envs):
            self.rewards[i].append(float(reward[i]))
            self.terminated[i].append(bool(terminated[i]))

    def pending(self) -> int:
        return 0

    def take(self) -> None:
        return None


def test_ale_games_with_several_envs_run_on_ale_py_s_vector_env_unless_asked_otherwise() -> None:
    from gymnasium.vector import SyncVectorEnv

    from srl.base.ale_vector import AleVectorEnv
    from srl.base.rollout import resolve_vectorization

    pong = EnvConfig(PONG)
    assert resolve_vectorization(pong, "auto", 2) == "ale"
    assert resolve_vectorization(pong, "auto", 1) == "sync"  # one env: gymnasium's, as before
    assert resolve_vectorization(pong, "ale", 1) == "ale"
    assert resolve_vectorization(pong, "sync", 8) == "sync"  # the way back to gymnasium's wrappers
    assert resolve_vectorization(EnvConfig(PONG, preprocessing="none"), "auto", 8) == "sync"
    assert resolve_vectorization(EnvConfig(PONG, mode=0), "auto", 8) == "sync"  # a setting it does not have
    assert resolve_vectorization(EnvConfig("CartPole-v1"), "auto", 8) == "sync"
    with pytest.raises(EnvError, match=r"not one of ale-py's games.*use 'sync'"):
        resolve_vectorization(EnvConfig("CartPole-v1"), "ale", 2)
    with pytest.raises(EnvError, match="has no setting for mode"):
        resolve_vectorization(EnvConfig(PONG, mode=0), "ale", 2)
    with pytest.raises(EnvError, match="vectorization must be one of"):
        resolve_vectorization(pong, "threads", 2)
    dqn.Config(vectorization="ale").validate()
    with pytest.raises(ValueError, match="vectorization must be one of"):
        dqn.Config(vectorization="threads").validate()
    # both paths: the same spec, observations of the same shape and dtype, a reset's stack copies of one frame
    spaces = {}
    for vectorization, kind in (("auto", AleVectorEnv), ("sync", SyncVectorEnv)):
        with Rollout(pong, Steps(2, 6), num_envs=2, seed=0, vectorization=vectorization) as rollout:
            assert isinstance(rollout.envs, kind)
            assert rollout.vectorization == ("ale" if kind is AleVectorEnv else "sync")
            spaces[vectorization] = rollout.spec
            first = rollout.obs.copy()
            assert (first.dtype, first.shape) == (np.uint8, (2, 4, 84, 84))
            assert (first == first[:, -1:]).all() and first.any()
            rollout.step()
            np.testing.assert_array_equal(rollout.obs[:, :3], first[:, 1:])  # each stack slides by one frame
            assert rollout.obs.dtype == np.uint8
    assert spaces["auto"] == spaces["sync"] and spaces["auto"].frame_stack == 4
    # a frame limit: 40 frames are 10 agent steps of 4 frames, counted after the no-op start
    with Rollout(EnvConfig(BREAKOUT, max_episode_steps=40), Steps(2, 4), num_envs=2, seed=0) as rollout:
        assert rollout.vectorization == "ale"
        cut: list = []
        while not cut:
            cut = rollout.step()
    assert [e.length for e in cut] == [10, 10][:len(cut)]


@pytest.mark.slow
def test_ale_py_s_vector_env_gives_gymnasium_s_stacks_rewards_and_episode_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    # without no-op starts and sticky actions both paths are deterministic: the same actions give the same game
    import gymnasium as gym

    from srl.base import ale_vector

    monkeypatch.setattr(ale_vector, "NOOP_MAX", 0)
    settings = ale_vector.ale_vector_kwargs(BREAKOUT, "atari", {"repeat_action_probability": 0.0})
    assert isinstance(settings, dict)
    vector = ale_vector.AleVectorEnv(settings, 1)
    env = gym.wrappers.FrameStackObservation(gym.wrappers.AtariPreprocessing(
        gym.make(BREAKOUT, frameskip=1, repeat_action_probability=0.0), noop_max=0), 4)
    try:
        obs, info = vector.reset(seed=0)
        expected, expected_info = env.reset(seed=0)
        np.testing.assert_array_equal(obs[0], expected)
        assert info["lives"][0] == expected_info["lives"]
        rng = np.random.default_rng(0)
        for step in range(5000):
            action = int(rng.integers(4))
            obs, reward, terminated, truncated, info = vector.step(np.array([action]))
            expected, expected_reward, expected_terminated, expected_truncated, expected_info = env.step(action)
            assert (reward[0], terminated[0], truncated[0]) == (expected_reward, expected_terminated,
                                                                expected_truncated), step
            assert reward.dtype == np.float32
            if terminated[0]:
                assert info["lives"][0] == 5  # same-step autoreset: the next game's lives, as gymnasium's vector env
                np.testing.assert_array_equal(info["final_obs"][0], expected)  # the game's last stack, whole
                assert info["_final_obs"][0]
                np.testing.assert_array_equal(obs[0], env.reset(seed=1)[0])  # and at once the next game's first
                break
            np.testing.assert_array_equal(obs[0], expected)
            assert info["lives"][0] == expected_info["lives"]
        else:
            raise AssertionError("a game of Breakout at random did not end in 5000 steps")
    finally:
        vector.close()
        env.close()


@pytest.mark.slow
def test_on_ale_py_s_vector_env_scores_are_raw_sums_and_each_env_restarts_alone() -> None:
    from srl.rl.memories.frames import check_stacks

    worker = Steps(3, 4)
    ended: list = []
    with Rollout(EnvConfig(BREAKOUT), worker, num_envs=3, seed=1) as rollout:
        assert rollout.vectorization == "ale"
        while len(ended) < 4:
            episodes = rollout.step()
            starting = np.zeros(3, bool)
            starting[[e.env_index for e in episodes]] = True
            check_stacks(worker.acted[-1], rollout.obs, starting)  # what sending each frame once relies on
            ended += episodes
    # every env's rewards: the episodes' scores are the sums of the raw rewards, their lengths the steps
    begun = [0, 0, 0]
    step_of: list[int] = []
    for resets in worker.resets[1:]:  # the first is the start of every env
        assert len(resets[0]) < 3  # an ended env is reset alone
    for episode in ended:
        i = episode.env_index
        rewards = worker.rewards[i][begun[i]:begun[i] + episode.length]
        assert episode.total_reward == sum(rewards) and worker.terminated[i][begun[i] + episode.length - 1]
        assert not any(worker.terminated[i][begun[i]:begun[i] + episode.length - 1])  # evaluating: one end a game
        begun[i] += episode.length
        step_of.append(begun[i])
    assert len(set(step_of)) > 1  # the envs ended at different steps, each on its own
    # rewards stay unclipped: an alien of Space Invaders is worth 5 to 30 points
    invaders = Steps(2, 6)
    with Rollout(EnvConfig("ALE/SpaceInvaders-v5"), invaders, num_envs=2, seed=0, vectorization="ale") as rollout:
        while not any(r > 1 for rewards in invaders.rewards for r in rewards) and rollout.env_steps < 4000:
            rollout.step()
    assert any(r > 1 for rewards in invaders.rewards for r in rewards)
    # a training worker sees the training signal: clipped rewards and a terminal step at each of 5 lost lives
    trainee = Steps(3, 4, training=True)
    with Rollout(EnvConfig(BREAKOUT), trainee, num_envs=3, seed=1) as rollout:
        games: list = []
        while not games:
            games = rollout.step()
    i, length = games[0].env_index, games[0].length
    assert set(trainee.rewards[i]) <= {0.0, 1.0} and sum(trainee.terminated[i][:length]) == 5


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["ppo", "dqn"])
def test_pong_trains_in_one_process_on_ale_py_s_vector_env(algorithm: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import srl.base.rollout
    from srl.base.ale_vector import AleVectorEnv

    built: list[int] = []

    class Counted(AleVectorEnv):
        def __init__(self, settings: dict, num_envs: int) -> None:
            built.append(num_envs)
            super().__init__(settings, num_envs)

    monkeypatch.setattr(srl.base.rollout, "AleVectorEnv", Counted)
    config: ppo.Config | dqn.Config = (
        ppo.Config(envs_per_actor=4, segment_length=32, epochs=1, minibatches=2, seed=1) if algorithm == "ppo"
        else small_dqn(envs_per_actor=4, env_steps_per_train=8.0))
    runner = srl.Runner(PONG, config)
    runner.train(max_steps=400)
    assert runner.env_steps >= 400 and built[0] == 4
    assert runner.train_count > 0


# ------------------------------------------------------------------ encoders
def test_encoders_are_chosen_from_the_observation() -> None:
    pong, minatar, cartpole = (env_spec(EnvConfig(i)) for i in (PONG, MINATAR, "CartPole-v1"))
    auto = EncoderConfig()
    assert (auto.check(pong), auto.check(minatar), auto.check(cartpole)) == ("nature_cnn", "minatar_cnn", "mlp")
    parameter = dqn.Config().make_parameter(pong, torch.device("cpu"))
    weights = sum(p.numel() for p in parameter.q.parameters())
    assert 1_650_000 < weights < 1_700_000  # the Nature CNN with a dueling head over Pong's 6 actions
    q = parameter.q(torch.zeros((2, 4, 84, 84), dtype=torch.uint8))
    assert q.shape == (2, 6)
    ac = ppo.Config(encoder=EncoderConfig("impala_cnn")).make_parameter(minatar, torch.device("cpu"))
    grids, actions = torch.zeros((3, 4, 10, 10), dtype=torch.bool), torch.zeros(3, dtype=torch.long)
    logprob, entropy, value = ac.net.evaluate(grids, actions)
    assert logprob.shape == entropy.shape == value.shape == (3,)
    assert ac.net.obs_rms.mean.shape == (1,)  # no per-pixel statistics travel with image params
    with pytest.raises(EncoderError, match="'mlp' takes vector observations"):
        EncoderConfig("mlp").check(pong)
    with pytest.raises(EncoderError, match="takes images"):
        EncoderConfig("nature_cnn").check(cartpole)
    with pytest.raises(EncoderError, match="36x36 and up"):
        EncoderConfig("nature_cnn").check(minatar)
    with pytest.raises(ValueError, match="did you mean 'nature_cnn'"):
        EncoderConfig("natur_cnn").validate()


def test_channels_last_images_are_moved_first_inside_the_network() -> None:
    spec = EnvSpec("hwc", (10, 10, 4), env_spec(EnvConfig(MINATAR)).actions, obs_dtype="bool")
    chw = EnvSpec("chw", (4, 10, 10), spec.actions, obs_dtype="bool")
    torch.manual_seed(0)
    a, _ = EncoderConfig("minatar_cnn").build(spec, dqn.Config().hidden_block)
    torch.manual_seed(0)
    b, _ = EncoderConfig("minatar_cnn").build(chw, dqn.Config().hidden_block)
    grid = torch.rand((2, 4, 10, 10)) > 0.5
    torch.testing.assert_close(a(grid.permute(0, 2, 3, 1)), b(grid))


def test_a_module_encoder_is_imported_only_where_the_node_allows_it() -> None:
    config = small_dqn(encoder=EncoderConfig("tests.test_pixels:tiny_encoder"))
    task = srl.Runner(MINATAR, config).task_config()
    with pytest.raises(TaskConfigError, match=r"import the module 'tests.test_pixels'.*--allow-env-modules"):
        build_task(json.dumps(task), allow_modules=frozenset())
    built = build_task(json.dumps(task), allow_modules=frozenset({"tests"}))
    spec = env_spec(built.env_config)
    parameter = built.rl_config.make_parameter(spec, torch.device("cpu"))
    assert parameter.q(torch.zeros((1, 4, 10, 10), dtype=torch.bool)).shape == (1, 3)


# ------------------------------------------------------------------ images on the wire and on disk
def image_rows(n: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    frames = np.zeros((n, 4, 84, 84), np.uint8)
    frames[:, :, 30:40, 20:30] = rng.integers(0, 256, (n, 4, 10, 10), dtype=np.uint8)  # mostly background
    return {"obs": frames, "grid": rng.random((n, 4, 10, 10)) < 0.1, "version": np.zeros(n, np.int64)}


@pytest.mark.parametrize("compress", [False, True])
def test_uint8_and_bool_columns_round_trip(compress: bool) -> None:
    codec = Codec(compress=compress)
    rows = image_rows(32)
    schema = Schema({"obs": Column("uint8", (4, 84, 84), 0, 255), "grid": Column("bool", (4, 10, 10)),
                     "version": Column("int64", (), 0)})
    assert schema.has_images
    blob = codec.encode_batch(BatchHeader("a", 0, 1, 0, 1, 32, 1.0), rows, None)
    assert (blob[6] & FLAG_ZSTD != 0) == compress
    if compress:
        assert len(blob) < rows["obs"].nbytes / 5  # frames of background compress many times over
    _, columns, _ = codec.decode_batch(blob, schema)
    for name, column in rows.items():
        assert columns[name].dtype == column.dtype
        np.testing.assert_array_equal(columns[name], column)


def test_a_uint8_value_beyond_its_declared_bound_is_refused() -> None:
    codec = Codec()
    rows = {"obs": np.full((2, 3), 7, np.uint8)}
    blob = codec.encode_batch(BatchHeader("a", 0, 1, 0, 1, 2, 1.0), rows, None)
    with pytest.raises(DecodeError, match="above its upper bound 3"):
        codec.decode_batch(blob, Schema({"obs": Column("uint8", (3,), 0, 3)}))
    with pytest.raises(DecodeError, match="dtype uint8, expected bool"):
        codec.decode_batch(blob, Schema({"obs": Column("bool", (3,))}))


def zstd_frame(payload: bytes, write_content_size: bool = True) -> bytes:
    body = zstandard.ZstdCompressor(level=1, write_content_size=write_content_size).compress(payload)
    return MAGIC + bytes([WIRE_VERSION, 1, FLAG_ZSTD]) + body


def test_a_zstd_bomb_and_a_frame_of_unstated_size_are_refused_before_they_expand() -> None:
    codec = Codec(max_bytes=1 << 20)
    with pytest.raises(DecodeError, match=r"expands to 67108864 bytes, past max_bytes=1048576"):
        codec.decode_batch(zstd_frame(bytes(64 << 20)))
    with pytest.raises(DecodeError, match="does not state its size"):
        codec.decode_batch(zstd_frame(bytes(100), write_content_size=False))
    good = zstd_frame(bytes(100))
    with pytest.raises(DecodeError, match="corrupt zstd payload"):
        codec.decode_batch(good[:-4])
    with pytest.raises(DecodeError, match="corrupt zstd payload"):
        codec.decode_batch(good + b"trailing")
    # a header that understates the size: libzstd refuses output past what the frame states
    body = bytearray(zstandard.ZstdCompressor(level=1).compress(bytes(5000)))
    descriptor = body[4]  # after the 4-byte magic: the size field's width, and whether a window byte follows
    assert descriptor >> 6 == 1, "a 2-byte size field (stored as size - 256)"
    size_at = 5 if descriptor & 0x20 else 6
    body[size_at:size_at + 2] = (300 - 256).to_bytes(2, "little")
    assert zstandard.frame_content_size(bytes(body)) == 300
    with pytest.raises(DecodeError, match="corrupt zstd payload"):
        codec.decode_batch(MAGIC + bytes([WIRE_VERSION, 1, FLAG_ZSTD]) + bytes(body))


def test_cnn_weights_travel_through_the_codec_and_a_checkpoint(tmp_path: Path) -> None:
    config = small_dqn()
    runner = srl.Runner(PONG, config)
    parameter = config.make_parameter(runner.spec, torch.device("cpu"))
    arrays = parameter.to_arrays()
    assert sum(a.size for a in arrays.values()) > 1_600_000
    codec = Codec(secret="k", task="t")
    _, back = codec.decode_params(codec.encode_params(arrays, {"version": 3}))
    other = config.make_parameter(runner.spec, torch.device("cpu"))
    other.from_arrays(back)
    for name, array in other.to_arrays().items():
        np.testing.assert_array_equal(array, arrays[name])
    from srl.base.arrays import load_arrays, save_arrays
    save_arrays(tmp_path / "w.safetensors", arrays, {"version": 3})
    _, loaded = load_arrays(tmp_path / "w.safetensors")
    assert loaded.keys() == arrays.keys() and all(np.array_equal(loaded[k], arrays[k]) for k in arrays)


# ------------------------------------------------------------------ one process and distributed, per algorithm
def minatar_configs() -> dict[str, object]:
    return {
        "dqn": small_dqn(env_steps_per_train=4.0, publish_every=20),
        "ppo": ppo.Config(envs_per_actor=2, segment_length=16, epochs=1, minibatches=1, seed=1),
        "impala": impala.Config(envs_per_actor=2, segment_length=8, batch_segments=2, buffer_segments=8, seed=1),
    }


@pytest.mark.parametrize("algorithm", ["dqn", "ppo", "impala"])
def test_minatar_trains_in_one_process_evaluates_and_round_trips_a_checkpoint(algorithm: str, tmp_path: Path) -> None:
    runner = srl.Runner(MINATAR, minatar_configs()[algorithm])  # type: ignore[arg-type]
    runner.train(max_steps=400)
    scores = runner.evaluate(max_episodes=2, seed=7)
    assert len(scores) == 2 and all(s >= 0 for s in scores)
    runner.save(tmp_path / "minatar.safetensors")
    again = srl.Runner.from_checkpoint(tmp_path / "minatar.safetensors")
    assert again.rl_config == runner.rl_config and again.env_config == runner.env_config
    assert again.evaluate(max_episodes=2, seed=7) == scores


@pytest.mark.slow
@pytest.mark.parametrize(("algorithm", "env"), [("dqn", MINATAR), ("ppo", MINATAR), ("impala", MINATAR), ("dqn", PONG),
                                              ("impala", PONG)])
def test_a_short_distributed_pixel_run_ends_with_an_evaluation(
    algorithm: str, env: str, redis_url: str, namespace: str
) -> None:
    runner = srl.Runner(env, minatar_configs()[algorithm])  # type: ignore[arg-type]
    short_distributed_run(runner, redis_url, namespace, 30)


# ------------------------------------------------------------------ frames once: the stacks the env produced
class Tee(Worker):
    """Acts with ``frames`` (a DQN worker on frame rows) and tells ``stacks`` (one on rows of stacks) the same
    steps, so both describe one trajectory."""

    def __init__(self, frames: dqn.DQNWorker, stacks: dqn.DQNWorker) -> None:
        self.a, self.b = frames, stacks
        self.num_envs = frames.num_envs

    def reset(self, env_ids: np.ndarray, obs: np.ndarray) -> None:
        self.a.reset(env_ids, obs)
        self.b.reset(env_ids, obs)

    def act(self, obs: np.ndarray) -> np.ndarray:
        action = self.a.act(obs)
        self.b._obs, self.b._action = obs, self.a._action
        return action

    def observe(self, reward: np.ndarray, next_obs: np.ndarray, terminated: np.ndarray, truncated: np.ndarray) -> None:
        self.a.observe(reward, next_obs, terminated, truncated)
        self.b.observe(reward, next_obs, terminated, truncated)

    def pending(self) -> int:
        return self.a.pending()

    def take(self) -> None:
        return None


def transition_set(obs: np.ndarray, next_obs: np.ndarray, action: np.ndarray, reward: np.ndarray,
                   discount: np.ndarray) -> list[tuple[bytes, bytes, int, float, float]]:
    return sorted((o.tobytes(), n.tobytes(), int(a), round(float(r), 5), round(float(d), 5))
                  for o, n, a, r, d in zip(obs, next_obs, action, reward, discount, strict=True))


@pytest.mark.slow
def test_frame_rows_and_the_frame_replay_give_back_exactly_the_stacks_the_env_produced() -> None:
    # Breakout: a lost life is terminal for the worker while the stacks go on; a 300-frame limit truncates
    # episodes; 3 envs autoreset on their own (same step); several takes split the streams
    env = EnvConfig(BREAKOUT, max_episode_steps=300)
    spec = env_spec(env)
    assert spec.frame_stack == 4
    frames_config = small_dqn(epsilon=1.0, envs_per_actor=3, memory=MemoryConfig(capacity=4000))  # prioritized
    stacks_config = small_dqn(epsilon=1.0, envs_per_actor=3, store_frames_once=False)
    assert frames_config.frame_rows(spec) and not stacks_config.frame_rows(spec)
    a = frames_config.make_worker(spec, frames_config.make_parameter(spec, torch.device("cpu")), 0, 1, 5)
    b = stacks_config.make_worker(spec, stacks_config.make_parameter(spec, torch.device("cpu")), 0, 1, 5)
    memory = frames_config.make_buffer(spec)
    schema = frames_config.schema(spec)
    sent: list[dict[str, np.ndarray]] = []
    ends = {"terminated": 0, "truncated": 0, "episodes": 0}
    with Rollout(env, Tee(a, b), num_envs=3, seed=11) as rollout:
        for step in range(700):
            ends["episodes"] += len(rollout.step())
            if step % 37 == 36 or step == 699:
                rows = a.take()
                if rows is not None:
                    assert schema.problem(rows, a.initial_priorities(rows)) is None
                    memory.add(rows, a.initial_priorities(rows))
                    sent.append(rows)
    assert ends["episodes"] >= 3  # truncations and game overs both happened in the run
    expected = b.take()
    assert expected is not None and (expected["discount"] == 0).any()  # lost lives (terminal steps) too
    # the stacks the frame rows make, against the env's own stacks, frame by frame
    got_obs, got_next, got = [], [], {k: [] for k in ("action", "reward", "discount")}
    for rows in sent:
        index, obs, next_obs = stacks_of(rows, 4)
        got_obs.append(obs)
        got_next.append(next_obs)
        for name in got:
            got[name].append(rows[name][index])
    mine = transition_set(np.concatenate(got_obs), np.concatenate(got_next), *(np.concatenate(got[k]) for k in got))
    theirs = transition_set(expected["obs"], expected["next_obs"], expected["action"], expected["reward"],
                            expected["discount"])
    assert mine == theirs
    # the replay keeps each frame about once and rebuilds the same stacks when sampled
    frames_sent = sum(len(rows["frame"]) for rows in sent)
    assert len(memory) == len(expected["action"]) and frames_sent <= 1.5 * len(memory)
    sample = memory.sample(4096)
    drawn = transition_set(sample.batch["obs"], sample.batch["next_obs"], sample.batch["action"],
                           sample.batch["reward"], sample.batch["discount"])
    assert set(drawn) <= set(theirs) and len(set(drawn)) > len(theirs) // 2


def pong_frame_rows(envs: int, transitions: int) -> tuple[dqn.DQNWorker, Schema, dict[str, np.ndarray]]:
    """A random-acting DQN worker of ``envs`` Pong envs, its schema, and the frame rows it took once it held
    ``transitions`` transitions."""
    spec = env_spec(EnvConfig(PONG))
    config = small_dqn(epsilon=1.0, envs_per_actor=envs)
    worker = config.make_worker(spec, config.make_parameter(spec, torch.device("cpu")), 0, 1, 0)
    with Rollout(EnvConfig(PONG), worker, num_envs=envs, seed=0) as rollout:
        while worker.pending() < transitions:
            rollout.step()
    rows = worker.take()
    assert rows is not None
    return worker, config.schema(spec), rows


def test_frame_rows_that_refer_outside_their_batch_are_refused() -> None:
    _, schema, rows = pong_frame_rows(2, 20)
    assert schema.problem(rows) is None
    assert schema.counted(rows) == 20 < len(rows["frame"])

    def broken(**changes: np.ndarray) -> str | None:
        return schema.problem({**rows, **changes})

    start = rows["stream_start"].copy()
    start[0] = False
    assert "begin a stream" in str(broken(stream_start=start))
    last = np.flatnonzero(rows["transition"])[-1]
    reach = last + rows["next_ahead"][last]  # the newest frame of the last transition's next observation
    assert reach == len(rows["frame"]) - 1
    cut = {name: column[:-1] for name, column in rows.items()}
    assert "past the end of the batch" in str(schema.problem(cut))
    for flag in ("stream_start", "first"):  # a stream or an episode that starts between a transition's stacks
        split = rows[flag].copy()
        split[reach] = True
        assert "another stream or episode" in str(broken(**{flag: split}))
    cut = {name: column[2:] for name, column in rows.items()}  # the first stack's older frames are gone
    cut["stream_start"][0] = True
    assert "reaches before" in str(schema.problem(cut))
    ahead = rows["next_ahead"].copy()
    ahead[np.flatnonzero(~rows["transition"])[0]] = 1
    assert "without a transition" in str(broken(next_ahead=ahead))


class Recording(Worker):
    """Forwards to ``worker`` and keeps every observation it acted on and every next observation."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.num_envs = worker.num_envs
        self.acted: list[np.ndarray] = []
        self.next: list[np.ndarray] = []

    def reset(self, env_ids: np.ndarray, obs: np.ndarray) -> None:
        self.worker.reset(env_ids, obs)

    def act(self, obs: np.ndarray) -> np.ndarray:
        self.acted.append(obs.copy())
        return self.worker.act(obs)

    def observe(self, reward: np.ndarray, next_obs: np.ndarray, terminated: np.ndarray, truncated: np.ndarray) -> None:
        self.next.append(next_obs.copy())
        self.worker.observe(reward, next_obs, terminated, truncated)

    def pending(self) -> int:
        return self.worker.pending()

    def take(self) -> None:
        return None


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["ppo", "impala"])
def test_segments_carry_t_plus_4_frames_and_give_back_the_env_s_stacks(algorithm: str) -> None:
    env = EnvConfig(BREAKOUT, max_episode_steps=200)
    spec = env_spec(env)
    config: ppo.Config | impala.Config = (ppo.Config(envs_per_actor=3, segment_length=16) if algorithm == "ppo"
                                          else impala.Config(envs_per_actor=3, segment_length=16))
    schema = config.schema(spec)
    assert schema.columns["frames"].shape == (16 + 4, 84, 84) and "obs" not in schema.columns
    worker = config.make_worker(spec, config.make_parameter(spec, torch.device("cpu")), 0, 1, 0)
    recording = Recording(worker)
    episodes = 0
    with Rollout(env, recording, num_envs=3, seed=2) as rollout:
        for _ in range(16 * 12):
            episodes += len(rollout.step())
    assert episodes >= 3  # resets inside segments, truncations and game overs among them
    segments = worker.take()
    assert segments is not None and schema.problem(segments) is None
    obs, last_obs = segment_observations(segments, 4)
    acted, after = np.stack(recording.acted), np.stack(recording.next)  # (steps, envs, 4, 84, 84)
    # segments come segment by segment (12 of them), env by env within one
    for k in range(12):
        for env_index in range(3):
            row = k * 3 + env_index
            np.testing.assert_array_equal(obs[row], acted[k * 16:(k + 1) * 16, env_index])
            np.testing.assert_array_equal(last_obs[row], after[(k + 1) * 16 - 1, env_index])
    assert segments["first"][:, 4:].any()  # episodes started inside segments


@pytest.mark.parametrize(("env", "changes"), [
    ("CartPole-v1", {"value_rescale": True}), ("CartPole-v1", {"double_q": False, "n_step": 1}),
    ("CartPole-v1", {"advantage_learning": 0.5}), ("CartPole-v1", {"advantage_learning": 0.5, "value_rescale": True}),
    (BREAKOUT, {}), (BREAKOUT, {"store_frames_once": False}), (BREAKOUT, {"advantage_learning": 0.5})])
def test_initial_priorities_from_the_q_values_acted_with_match_a_fresh_forward_pass(
    env: str, changes: dict[str, object]
) -> None:
    config = small_dqn(epsilon=0.5, envs_per_actor=3, **changes)
    env_config = EnvConfig(env, max_episode_steps=40 if env == "CartPole-v1" else 200)
    spec = env_spec(env_config)
    worker = config.make_worker(spec, config.make_parameter(spec, torch.device("cpu")), 0, 1, 0)
    with Rollout(env_config, worker, num_envs=3, seed=4) as rollout:
        ends = 0
        for step in range(150):
            ends += len(rollout.step())
            if step % 50 == 49:  # taken with transitions still waiting for their next Q
                rows = worker.take()
                assert rows is not None
                acted = worker.initial_priorities(rows)
                fresh = worker.initial_priorities(dict(rows))  # not the taken rows: computed anew
                np.testing.assert_allclose(acted, fresh, rtol=1e-4, atol=1e-4)
                assert (acted > 0).sum() >= 0.5 * config.schema(spec).counted(rows)
    assert ends > 0


def test_frame_rows_are_cut_into_messages_only_where_a_stream_starts() -> None:
    from srl.runner.distribution.wire.codec import split_columns

    worker, schema, rows = pong_frame_rows(4, 80)
    assert schema.split_at == "stream_start"
    priorities = worker.initial_priorities(rows)
    stream = int(np.diff(np.flatnonzero(rows["stream_start"])).max())
    chunks = split_columns(rows, priorities, stream + 3, rows["stream_start"])
    assert len(chunks) > 1
    for columns, chunk_priorities in chunks:
        assert columns["stream_start"][0] and schema.problem(columns, chunk_priorities) is None
    for name, column in rows.items():
        np.testing.assert_array_equal(np.concatenate([c[name] for c, _ in chunks]), column)
    with pytest.raises(ValueError, match=r"must travel together.*lower the actor's batch_size"):
        split_columns(rows, priorities, stream - 1, rows["stream_start"])
    assert len(split_columns(rows, priorities, 7)) > 1  # cut anywhere, as transitions are


@pytest.mark.slow
def test_a_replay_too_big_for_the_trainer_is_refused_with_its_real_size(redis_url: str, namespace: str) -> None:
    from srl.runner.distribution.client.train import TaskFailedError

    config = dqn.Config()
    config.memory.capacity = 100_000
    runner = srl.Runner(PONG, config)
    with pytest.raises(TaskFailedError, match=r"needs 0\.7\d GiB \(7,\d{3} bytes per stored row\); this trainer "
                                              r"allows 0\.09 GiB \(--max-buffer-bytes\)"):
        runner.train_distribution(RedisParameters(url=redis_url, task_name=namespace), actor_num=1,
                                  max_train_count=10, local_processes=True, progress_interval=None,
                                  trainer_options={"max_buffer_bytes": 100_000_000})


def test_a_frame_replay_saved_in_a_checkpoint_loads_with_the_same_stacks() -> None:
    spec = env_spec(EnvConfig(PONG))
    config = small_dqn(epsilon=1.0, envs_per_actor=2, memory=MemoryConfig(capacity=300))
    worker = config.make_worker(spec, config.make_parameter(spec, torch.device("cpu")), 0, 1, 0)
    memory = config.make_buffer(spec)
    with Rollout(EnvConfig(PONG), worker, num_envs=2, seed=0) as rollout:
        while memory.total_added < 400:  # past its capacity: the ring has wrapped
            rollout.step()
            if worker.pending() >= 64:
                rows = worker.take()
                assert rows is not None
                memory.add(rows, worker.initial_priorities(rows))
    saved = memory.state_arrays()
    assert saved is not None
    arrays, meta = saved
    assert memory.state_nbytes() >= arrays["frames"].nbytes
    again = config.make_buffer(spec)
    again.load_state_arrays(arrays, meta)
    assert len(again) == len(memory) == 300

    def stored(m: FrameMemory) -> list[tuple[bytes, bytes, int, float, float]]:
        rows = m.inner._ring.state()  # type: ignore[attr-defined]  # oldest first
        return transition_set(m._frames[rows["obs_frames"] % m.frame_capacity],
                              m._frames[rows["next_frames"] % m.frame_capacity],
                              rows["action"], rows["reward"], rows["discount"])

    assert isinstance(memory, FrameMemory) and isinstance(again, FrameMemory)
    assert stored(again) == stored(memory)
    assert again.sample(64).batch["obs"].shape == (64, 4, 84, 84)
    other = small_dqn(memory=MemoryConfig(capacity=600)).make_buffer(spec)
    with pytest.raises(ValueError, match="frame ring"):
        other.load_state_arrays(arrays, meta)


def test_stacks_that_do_not_slide_or_start_as_copies_are_refused() -> None:
    rng = np.random.default_rng(0)
    before = rng.integers(0, 256, (2, 4, 6, 6), dtype=np.uint8)
    after = np.concatenate([before[:, 1:], rng.integers(0, 256, (2, 1, 6, 6), dtype=np.uint8)], axis=1)
    check_stacks(before, after, np.zeros(2, bool))  # slid by one frame
    reset = np.repeat(after[:, -1:], 4, axis=1)
    check_stacks(before, reset, np.ones(2, bool))  # copies of the first frame
    with pytest.raises(RuntimeError, match="slide by one frame"):
        check_stacks(before, before, np.zeros(2, bool))
    with pytest.raises(RuntimeError, match="copies of its reset frame"):
        check_stacks(before, after, np.array([False, True]))
