"""The role interfaces every algorithm implements, and the data path it declares.

Owns: ``RLConfig`` (an algorithm's settings as one dataclass, and the factory
of its parts), ``DataPath`` (what the algorithm's rows are, when its trainer
publishes, which params versions it accepts, how fast actors may go),
``Parameter`` (the weights, to and from arrays without pickle), ``Worker``
(acts in E envs at once and turns their steps into rows), ``Buffer`` (where
the trainer keeps rows until it learns from them) and ``Learner`` (learns from
its buffer). Must never: import anything distributed. The same objects run in
one process (``Runner.train``) and split across machines (actor and trainer
processes), with the same columns.

The loops that call them::

    # an actor (or Runner.train)                   # the trainer
    rollout = Rollout(env, worker, num_envs=E)       while not done:
    while running:                                       stats = trainer.train()   # one update, or None:
        rollout.step()   # worker.act / observe                                     # not enough data yet
        rows = worker.take()                             if time to publish (data_path.publish_every):
        if rows is not None:                                 blob = parameter.to_arrays() -> board
            send(rows, worker.initial_priorities(rows))  # or buffer.add(rows, priorities)

Every row carries the ``version`` of the params it was acted with (a column),
so policy lag is data. The params version counts publications; ``train_count``
counts gradient steps; they are different counters.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeVar

import numpy as np
import torch
from torch.distributions import Categorical, Normal

from srl.base.config import Settings, check_int
from srl.base.env import EnvConfig, EnvSpec
from srl.base.rollout import VECTORIZATIONS
from srl.base.schema import Schema

Columns = dict[str, np.ndarray]
"""Rows as columns; every array has the same leading length."""

DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:[0-9]{1,2})?")
MAX_ENVS_PER_ACTOR = 1024


def seed_everything(seed: int | None) -> None:
    """Seed Python's, numpy's and torch's generators (``RLConfig.seed``; None: leave them as they are)."""
    if seed is None:
        return
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@dataclass(frozen=True)
class DataPath:
    """How an algorithm's experience travels from its workers to its trainer.

    The distribution layer reads this and never branches on the algorithm;
    ``Runner.train`` reads it too, so one process follows the same rules.
    """

    rows: Literal["transitions", "segments"]
    """what one row is: an (n-step) transition, or a segment of T steps of one env"""
    publish_every: int = 0
    """publish params every this many train steps (gradient steps); 0: after every update"""
    sync: bool = False
    """on-policy in lockstep: actors wait for a new params version after each segment; the trainer
    takes rows of the current version only and trains once it has one segment per env of every actor"""
    max_policy_lag: int | None = None
    """rows acted with params more than this many versions behind are refused (counted, shown);
    None: any age (off-policy)"""
    sync_wait_s: float = 30.0
    """sync: seconds the trainer waits for every actor's segments before it goes on with what it has"""
    min_segments: int = 1
    """sync: the fewest segments the trainer goes on with after ``sync_wait_s``"""
    env_steps_per_train: float | None = None
    """replay ratio: env steps (all actors together) per train step; actors wait past it, and one
    process trains to keep it. None: not limited (on-policy data paths pace themselves)"""
    warmup_rows: int = 0
    """rows the trainer needs before its first update (actors may run that far ahead of the replay ratio)"""
    row_steps: int = 1
    """new env steps one row brings, for the replay ratio: 1 for a transition, the steps between two
    overlapping sequences for R2D2's"""
    row_lead: int = 0
    """env steps an env takes before its first row beyond ``row_steps`` (R2D2: the overlap of its sequences)"""
    lead_versions: int | None = None
    """asynchronous segments: an actor makes at most its share of this many params versions' rows ahead of
    the learner (``segments_per_version``), so what it acts now is trained within about that many versions,
    well inside ``max_policy_lag``: without it a learner-bound run fills the queue and the trainer's buffer
    with rows that age past the lag and are refused (Cleanba bounds its queue for the same reason). None:
    not paced, backpressure alone"""
    version_segments: int = 0
    """segments one params version consumes, all actors together; 0: one per env of every actor (an update
    of asynchronous PPO, ``update_segments``)"""
    segment_length: int = 0
    """segments: env steps of one env per row; an actor whose segments a central inference server makes counts
    them from its envs' steps with it (its lead, ``lead_versions``). 0: not known"""

    # ---------------------------------------------------------------- the rules it implies, in one place:
    # Runner.train, the actor, the trainer and bench/learning.py all ask these, so a version and a replay
    # ratio mean the same in one process and distributed.

    FIRST_VERSION: ClassVar[int] = 1
    """the version of a learner's first weights (0 means: no params yet)"""

    def next_version(self, version: int, train_count: int) -> int:
        """The params version of the learner's weights after an update that brought it to ``train_count``
        gradient steps, from ``version`` before it: one more per update when it publishes after every update
        (``publish_every`` 0), else one per ``publish_every`` train steps (``train_count // publish_every``
        + 1). A distributed trainer publishes the version this says, skipping those a publication interval
        merged, so a version means the same number of train steps wherever it is counted."""
        if self.publish_every == 0:
            return version + 1
        return max(version, train_count // self.publish_every + self.FIRST_VERSION)

    def train_credit(self, env_steps: int) -> float:
        """Train steps ``env_steps`` env steps pay for under the replay ratio (one process trains them as they
        come); only for a data path with ``env_steps_per_train``."""
        assert self.env_steps_per_train is not None
        return env_steps / self.env_steps_per_train

    def env_steps_allowed(self, train_steps: int) -> float:
        """Env steps (all actors together) the replay ratio allows once the trainer made ``train_steps``: the
        warmup's rows, then ``env_steps_per_train`` per train step."""
        assert self.env_steps_per_train is not None
        return self.warmup_rows * self.row_steps + self.env_steps_per_train * train_steps

    def first_rows_steps(self, envs: int) -> int:
        """Env steps ``envs`` envs take beyond ``row_steps`` per row before their rows come (an actor's slack
        under the replay ratio, so the warmup's rows are not held back by the steps that precede them): each
        env's ``row_lead`` before its first row, and up to ``row_steps - 1`` more before the row that crosses
        the allowance is emitted (rows of E envs come E at a time)."""
        return envs * (self.row_lead + self.row_steps - 1)

    def train_steps_allowed(self, rows: int, ahead: float = 1.0) -> float:
        """Train steps ``rows`` received pay for (those past the warmup's), ``ahead`` times over."""
        assert self.env_steps_per_train is not None
        return ahead * max(0, rows - self.warmup_rows) * self.row_steps / self.env_steps_per_train

    @staticmethod
    def update_segments(actor_num: int, envs_per_actor: int) -> int:
        """Segments one on-policy update learns from: one per env of every actor."""
        return actor_num * envs_per_actor

    def segments_per_version(self, actor_num: int, envs_per_actor: int) -> int:
        """Segments the learner consumes per params version it publishes, all actors together."""
        return self.version_segments or self.update_segments(actor_num, envs_per_actor)

    @staticmethod
    def lead_of(max_policy_lag: int | None) -> int | None:
        """The ``lead_versions`` an asynchronous path with ``max_policy_lag`` paces its actors to: half the
        lag (the other half is for the params an actor acts with to reach it and for a trainer's buffer)."""
        return None if max_policy_lag is None else max(1, max_policy_lag // 2)


_C = TypeVar("_C", bound="RLConfig")


@dataclass
class RLConfig(Settings, ABC):
    """Settings shared by every algorithm; each algorithm's ``Config`` extends it."""

    algorithm: ClassVar[str] = ""
    """registry name of the algorithm (e.g. "dqn")"""
    saved_before: ClassVar[dict[str, Any]] = {}
    """fields added after checkpoints of this algorithm were first written, each with the value that a saved
    config without it meant (how the algorithm behaved before the field existed)"""
    weights_depend_on: ClassVar[tuple[str, ...]] = ()
    """fields that change what the weights mean without changing their shapes: weights made under other
    values are refused on load"""

    envs_per_actor: int = 1
    """envs each actor (and Runner.train) steps at once, one batched inference for all of them; an env
    whose episode ends is reset alone"""
    vectorization: str = "auto"
    """how those envs run: "sync" (gymnasium's, one process, in turn; best for fast envs), "async"
    (gymnasium's, a process per env; pays off when one env step costs milliseconds), "ale" (ale-py's C++
    vector env, for ALE games under the atari preprocessing) or "auto" (the default: "ale" where that
    fits and the envs are two or more, else "sync"); "sync" falls back to gymnasium's Atari wrappers"""
    device: str = "auto"
    """torch device: "auto" (CUDA when available), "cpu", "cuda", "cuda:1", ..."""
    torch_threads: int = 1
    """torch CPU threads per process (small nets run fastest on one)"""
    seed: int | None = None
    """seed for torch, numpy and the envs; None draws one"""
    draw_ahead: bool | None = None
    """a replay learner (DQN, R2D2, SAC) draws its next batch (the sample, the rows' copy to the device) on a
    side thread while the current step runs, so the device does not wait for the host; its priorities are then
    a step old. None: on where the learner runs on CUDA, off on the CPU"""
    torch_compile: bool = False
    """``torch.compile`` the learner's networks (their forward passes); the first steps wait for the compiler.
    See ``bench/gpu.py`` for what it gains where"""
    autocast_bf16: bool = False
    """the learner's forward passes and losses under bf16 autocast (weights, gradients and the optimizer stay
    float32). See ``bench/gpu.py`` for what it gains where"""

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            device = torch.device(self.device)
        except RuntimeError as e:
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}") from e
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} asked for but CUDA is not available here; use 'auto' or 'cpu'")
        return device

    def settled(self, env_config: EnvConfig) -> RLConfig:
        """This config with the settings it leaves to the env (``None`` until then) set: a copy when any
        was, so one config can serve several envs. The runner calls it before training, and for a
        distributed run the client, so every node gets the same values."""
        return self

    def budget_settings(self, max_steps: int | None, max_train_count: int | None) -> dict[str, Any]:
        """The settings this config derives from a run's budget (env steps, train steps; None: not bounded),
        by field name: those of its fields left at None that depend on how long the run is (R2D2's target
        period). The learner applies them in ``Learner.plan``; the runner and the client say them at the
        start. None by default."""
        return {}

    def unsettled(self) -> list[str]:
        """The fields :meth:`settled` would still set (a node refuses a task that has any)."""
        return []

    def validate(self) -> None:
        """Raise ValueError naming the field when a setting cannot work (or is beyond any sane bound:
        a config may come from an untrusted board)."""
        check_int("envs_per_actor", self.envs_per_actor, 1, MAX_ENVS_PER_ACTOR)
        check_int("torch_threads", self.torch_threads, 1, 256)
        if self.seed is not None:
            check_int("seed", self.seed, 0, 2**63 - 1)
        if self.vectorization not in VECTORIZATIONS:
            raise ValueError(f"vectorization must be one of {list(VECTORIZATIONS)}, "
                             f"got {str(self.vectorization)[:40]!r}")
        if not isinstance(self.device, str) or not DEVICE_PATTERN.fullmatch(self.device):
            raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {str(self.device)[:40]!r}")

    def copy(self) -> RLConfig:
        return dataclasses.replace(self)

    def imported_modules(self) -> list[str]:
        """The modules building this config's networks would import (a ``module:callable`` encoder): a node
        refuses a task naming one it does not allow, before it builds anything."""
        found: list[str] = []
        for f in dataclasses.fields(self):
            imported = getattr(getattr(self, f.name), "imported_module", None)
            name = imported() if callable(imported) else None
            if isinstance(name, str):
                found.append(name)
        return found

    def check_spec(self, spec: EnvSpec) -> None:
        """Raise EnvError when this algorithm cannot act in ``spec``'s spaces (say which it takes)."""

    def resolved(self: _C, spec: EnvSpec) -> _C:
        """A copy with the fields this config leaves to the env's family (``None``) set for ``spec``: what
        the learner, the worker and ``data_path`` (a segment's length) use on a node. Itself by default."""
        return self

    @abstractmethod
    def data_path(self) -> DataPath:
        """How this algorithm's rows travel and when its trainer publishes (see ``DataPath``); call it on
        ``resolved(spec)`` where a field it reads may be left to a preset (a segment's length)."""

    @abstractmethod
    def schema(self, spec: EnvSpec) -> Schema:
        """The columns this algorithm's worker emits for ``spec`` (what the trainer's buffer holds and
        what every batch from an actor must match); a ``version`` int64 column among them."""

    @abstractmethod
    def make_parameter(self, spec: EnvSpec, device: torch.device) -> Parameter: ...

    @abstractmethod
    def make_worker(
        self, spec: EnvSpec, parameter: Parameter, actor_index: int, actor_num: int, seed: int | None
    ) -> Worker:
        """A worker for ``envs_per_actor`` envs; actor ``actor_index`` of ``actor_num``."""

    @abstractmethod
    def make_buffer(self, spec: EnvSpec, actor_num: int = 1) -> Buffer:
        """Where the trainer keeps rows (allocated from ``schema(spec)``), for ``actor_num`` actors."""

    @abstractmethod
    def make_learner(self, spec: EnvSpec, parameter: Parameter, buffer: Buffer, actor_num: int = 1) -> Learner:
        """The learner, for rows from ``actor_num`` actors."""


class Parameter(ABC):
    """An algorithm's weights. ``version`` is the params version they are (0: never published)."""

    version: int = 0

    @abstractmethod
    def to_arrays(self) -> dict[str, np.ndarray]: ...

    @abstractmethod
    def from_arrays(self, arrays: dict[str, np.ndarray]) -> None: ...


def torch_to_arrays(modules: dict[str, torch.nn.Module]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for prefix, module in modules.items():
        for name, tensor in module.state_dict().items():
            out[f"{prefix}.{name}"] = tensor.detach().to("cpu").numpy().copy()
    return out


def torch_from_arrays(modules: dict[str, torch.nn.Module], arrays: dict[str, np.ndarray]) -> None:
    """Load arrays into modules; missing or mis-shaped entries raise ValueError naming them, before any
    module is changed (entries no module names are left alone)."""
    states: list[tuple[torch.nn.Module, dict[str, torch.Tensor]]] = []
    for prefix, module in modules.items():
        current = module.state_dict()
        state: dict[str, torch.Tensor] = {}
        for name, tensor in current.items():
            key = f"{prefix}.{name}"
            if key not in arrays:
                raise ValueError(f"parameters lack {key!r}: they were made by another algorithm or network shape")
            if tuple(arrays[key].shape) != tuple(tensor.shape):
                raise ValueError(
                    f"parameter {key!r} has shape {tuple(arrays[key].shape)}, this network expects "
                    f"{tuple(tensor.shape)}: the hidden layers, the recurrent cell (recurrent_size, cell_first) or the "
                    "env differ"
                )
            state[name] = torch.as_tensor(np.array(arrays[key]), dtype=tensor.dtype)
        states.append((module, state))
    for module, state in states:
        module.load_state_dict(state)


def concat_rows(parts: list[Columns]) -> Columns | None:
    """Rows made in several parts as one set of columns (None for none; one part as it is)."""
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    return {name: np.concatenate([rows[name] for rows in parts]) for name in parts[0]}


def worker_generator(seed: int | None) -> torch.Generator:
    """A worker's own CPU generator for its sampling draws (one drawn from the OS when ``seed`` is None):
    its own, so an inference server acting for many workers draws each one's from its own."""
    if seed is None:
        seed = int(np.random.SeedSequence().generate_state(1)[0])
    return torch.Generator().manual_seed(seed)


class Worker(ABC):
    """Acts in ``num_envs`` envs at once and turns their steps into rows (see the module docstring).

    ``Rollout`` calls ``reset`` when episodes start, ``act`` with every env's observation, and
    ``observe`` with what followed; the owner takes finished rows with ``take``.
    """

    training: bool = True
    """False while evaluating: act greedily / with the mean action, emit no rows"""
    num_envs: int = 1

    def reset(self, env_ids: np.ndarray, obs: np.ndarray) -> None:  # noqa: B027 - an optional hook
        """Episodes start in envs ``env_ids`` with first observations ``obs``."""

    @abstractmethod
    def act(self, obs: np.ndarray) -> np.ndarray:
        """The env actions for observations ``(E, *obs_shape)``: ``(E,)`` ints, ``(E, *shape)`` floats, ..."""

    @abstractmethod
    def observe(self, reward: np.ndarray, next_obs: np.ndarray, terminated: np.ndarray, truncated: np.ndarray) -> None:
        """What the last ``act`` led to, per env (``next_obs`` is an ended episode's final observation)."""

    @abstractmethod
    def pending(self) -> int:
        """Rows finished and not yet taken."""

    @abstractmethod
    def take(self) -> Columns | None:
        """The finished rows as columns (None when there are none); they leave the worker."""

    def plan(self, max_steps: int | None, max_train_count: int | None) -> None:  # noqa: B027 - optional
        """The run's budget (env steps, gradient steps; None: not bounded), for exploration that anneals over
        it (DQN's ε). Nothing by default."""

    def initial_priorities(self, columns: Columns) -> np.ndarray | None:
        """A priority per row for a prioritized buffer (|TD error| with the worker's weights), or None."""
        return None

    def ahead(self, obs: np.ndarray) -> None:  # noqa: B027 - an optional hook
        """The observations the next ``act`` is called with, as soon as ``Rollout`` knows them (after a step's
        ``observe`` and ``reset``): a worker that acts remotely may send them now. Nothing by default."""

    def may_load_params(self) -> bool:
        """Whether new params may be loaded now (a segment is acted with one version: not mid-segment)."""
        return True

    def stats(self) -> dict[str, float]:
        """What the worker wants shown (e.g. its exploration rate)."""
        return {}

    # ---------------------------------------------------------------- central inference
    # ``act`` in three parts, so one inference server runs the network once for the workers of many actors
    # (SEED RL): ``act(obs)`` is ``act_with(obs, policy(policy_inputs(obs)))``; the server joins the
    # inputs of several workers (``join_policy_io``), calls ``policy`` once and hands each worker its rows
    # of the outputs (``split_policy_io``). ``policy`` depends on the weights only, never on the worker.

    def policy_inputs(self, obs: np.ndarray) -> PolicyIO:
        """The network's inputs for observations ``(E, *obs_shape)`` (with the envs' recurrent state), as
        tensors whose first dimension is the env."""
        raise NotImplementedError(f"{type(self).__name__} cannot act with central inference")

    def policy(self, inputs: PolicyIO) -> PolicyIO:
        """The network's outputs for ``inputs`` (of one worker's envs, or of several workers' joined)."""
        raise NotImplementedError(f"{type(self).__name__} cannot act with central inference")

    def act_with(self, obs: np.ndarray, outputs: PolicyIO) -> np.ndarray:
        """``act`` given the network's outputs for ``obs`` (this worker's rows of ``policy``)."""
        raise NotImplementedError(f"{type(self).__name__} cannot act with central inference")

    def serves_central(self) -> bool:
        """Whether this worker implements the three parts above."""
        return type(self).policy is not Worker.policy


PolicyIO = tuple[Any, ...]
"""A network's inputs or outputs: tensors with the env first, None, distributions, lists and tuples of them."""


def join_policy_io(parts: list[PolicyIO]) -> PolicyIO:
    """The inputs of several workers as one batch (row blocks in order)."""
    return tuple(_join([part[i] for part in parts]) for i in range(len(parts[0])))


def _join(items: list[Any]) -> Any:
    first = items[0]
    if first is None:
        return None
    if isinstance(first, torch.Tensor):
        return first if len(items) == 1 else torch.cat(items)
    if isinstance(first, (list, tuple)):
        return type(first)(_join([item[i] for item in items]) for i in range(len(first)))
    raise TypeError(f"cannot join policy inputs of type {type(first).__name__}")


def split_policy_io(outputs: PolicyIO, sizes: list[int]) -> list[PolicyIO]:
    """The rows of each of ``sizes`` consecutive blocks of a batch's ``outputs``."""
    bounds = [0, *itertools.accumulate(sizes)]  # (numpy's cumsum of a short list costs more than the slicing)
    return [tuple(_rows(item, bounds[k], bounds[k + 1]) for item in outputs) for k in range(len(sizes))]


def _rows(item: Any, start: int, end: int) -> Any:
    if item is None:
        return None
    if isinstance(item, torch.Tensor):
        return item[start:end]
    if isinstance(item, Normal):
        return Normal(item.loc[start:end], item.scale[start:end], validate_args=False)
    if isinstance(item, Categorical):
        return Categorical(logits=item.logits[start:end], validate_args=False)
    if isinstance(item, (list, tuple)):
        return type(item)(_rows(x, start, end) for x in item)
    raise TypeError(f"cannot split policy outputs of type {type(item).__name__}")


class Buffer(ABC):
    """Where the trainer keeps rows between their arrival and learning (a replay memory, a FIFO).

    One thread may add (the trainer's ingest) while another learns from it; implementations lock.
    """

    @abstractmethod
    def add(self, columns: Columns, priorities: np.ndarray | None = None) -> None:
        """Store rows (with initial priorities where the buffer uses them)."""

    @abstractmethod
    def __len__(self) -> int:
        """Rows held now."""

    def room(self) -> int | None:
        """Rows it can take before the ingest must wait (None: it never fills, the oldest rows go)."""
        return None

    def grow(self, rows: int) -> bool:
        """Hold up to ``rows`` rows from now on, the ones held kept in order (a bounded FIFO whose trainer reads
        over a long round trip); False where it cannot (its size is the algorithm's)."""
        return False

    @property
    def nbytes(self) -> int:
        """Bytes its storage takes when full (checked against what a trainer may allocate)."""
        return 0

    def state_nbytes(self) -> int | None:
        """Bytes :meth:`state_arrays` would copy now (None: it keeps nothing), told without copying."""
        return None

    def state_arrays(self) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
        """The rows it holds (and what sampling them depends on) as arrays and JSON, for a checkpoint that
        keeps the memory; None when it keeps nothing worth saving (an on-policy buffer)."""
        return None

    def load_state_arrays(self, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> None:
        """Fill an empty buffer with what ``state_arrays`` wrote; ValueError saying what does not fit."""
        raise ValueError(f"a {type(self).__name__} keeps no state to load")


@dataclass
class TrainStats:
    """What one update reports; each algorithm extends it with its own fields (all numbers)."""

    loss: float
    gradient_steps: int = 1
    """optimizer steps this update made (train_count grows by this)"""

    def scalars(self) -> dict[str, float]:
        """Every field as a float, for progress lines, the board and history files."""
        return {f.name: float(getattr(self, f.name)) for f in dataclasses.fields(self)}


def optimizer_to_arrays(
    optimizer: torch.optim.Optimizer, prefix: str = "optimizer"
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """An optimizer's state as arrays (``<prefix>/<param>/<name>``) and its hyper-parameters as JSON."""
    state = optimizer.state_dict()
    arrays: dict[str, np.ndarray] = {}
    for index, entries in state["state"].items():
        for name, value in entries.items():
            tensor = value if isinstance(value, torch.Tensor) else torch.tensor(value)
            arrays[f"{prefix}/{int(index)}/{name}"] = tensor.detach().to("cpu").numpy().copy()
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items()}
              for group in state["param_groups"]]
    return arrays, {"param_groups": groups}


def optimizer_from_arrays(
    optimizer: torch.optim.Optimizer, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any],
    prefix: str = "optimizer",
) -> None:
    """Load what ``optimizer_to_arrays`` wrote; ValueError naming what does not fit this optimizer."""
    current = optimizer.state_dict()
    groups = meta.get("param_groups")
    if not isinstance(groups, list) or len(groups) != len(current["param_groups"]):
        raise ValueError("the optimizer state has another number of parameter groups than this optimizer")
    shapes: dict[int, tuple[int, ...]] = {}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for group, saved in zip(current["param_groups"], groups, strict=True):
        if not isinstance(saved, dict) or saved.get("params") != group["params"]:
            raise ValueError("the optimizer state was made for another network (its parameter lists differ)")
        for index in group["params"]:
            shapes[index] = tuple(params[index].shape)
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in arrays.items():
        parts = key.split("/")
        if len(parts) != 3 or parts[0] != prefix or not parts[1].isdigit() or int(parts[1]) not in shapes:
            raise ValueError(f"unexpected optimizer entry {key!r}")
        index, name = int(parts[1]), parts[2]
        if value.ndim and tuple(value.shape) != shapes[index]:
            raise ValueError(f"optimizer entry {key!r} has shape {tuple(value.shape)}, the parameter is "
                             f"{shapes[index]}")
        state.setdefault(index, {})[name] = torch.as_tensor(np.array(value))
    loaded_groups = []
    for group, saved in zip(current["param_groups"], groups, strict=True):
        merged = dict(group)
        for k, v in saved.items():
            if k in group and k != "params":
                merged[k] = tuple(v) if isinstance(group[k], tuple) else v
        loaded_groups.append(merged)
    optimizer.load_state_dict({"state": state, "param_groups": loaded_groups})


class Learner(ABC):
    """Learns from a buffer and updates the parameter; ``train_count`` counts gradient steps."""

    train_count: int = 0
    optimizer: torch.optim.Optimizer | None = None
    """the optimizer whose state a checkpoint keeps (None: nothing to keep)"""

    @abstractmethod
    def train(self) -> TrainStats | None:
        """One update (one or more gradient steps), or None when the buffer does not hold enough."""

    def plan(self, max_steps: int | None, max_train_count: int | None,  # noqa: B027 - optional
             env_steps: int = 0) -> None:
        """The run's budget (env steps, gradient steps; None: not bounded) and its ``env_steps`` so far (a
        trainer that takes a run over, a ``train`` call after another), for schedules that anneal over it
        (PPO's learning rate). Nothing by default."""

    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        """Every optimizer a checkpoint keeps, by the name its entries go under: ``optimizer`` alone by
        default; a learner with several (SAC's critic, actor and temperature) names each."""
        return {} if self.optimizer is None else {"optimizer": self.optimizer}

    def state_arrays(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """What a checkpoint keeps beyond the weights: the state of each of ``optimizers()``,
        ``train_count`` and what ``extra_state`` adds, as arrays and JSON (no pickle)."""
        arrays, meta = self.extra_state()
        meta = {"train_count": self.train_count, **meta}
        for name, optimizer in self.optimizers().items():
            opt_arrays, opt_meta = optimizer_to_arrays(optimizer, name)
            arrays.update(opt_arrays)
            meta[name] = opt_meta
        return arrays, meta

    def load_state_arrays(self, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> None:
        """Restore what ``state_arrays`` wrote (after the weights are loaded); ValueError if it does not fit."""
        optimizers = self.optimizers()
        for name, optimizer in optimizers.items():
            if isinstance(meta.get(name), dict):
                optimizer_from_arrays(optimizer, {k: v for k, v in arrays.items() if k.startswith(name + "/")},
                                      meta[name], name)
        count = meta.get("train_count", self.train_count)
        if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count < 2**62:
            raise ValueError(f"train_count {count!r} in the trainer state is not a count")
        self.train_count = count
        kept = {"optimizer", *optimizers}
        extra = {k: v for k, v in arrays.items() if k.partition("/")[0] not in kept}
        self.load_extra_state(extra, meta)

    def extra_state(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """An algorithm's own training state (a target network, running statistics, schedule counters)."""
        return {}, {}

    def load_extra_state(self, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> None:  # noqa: B027
        """Restore ``extra_state``. Nothing by default."""

    def takeover_state(self) -> dict[str, Any]:
        """What a trainer taking the run over needs beyond the weights, ``train_count`` and the run's env steps
        (``plan``): running statistics the updates scale by (PPO's return scale). Every params message
        carries it in its meta, so it is small and JSON; the optimizer state and a replay memory travel only in
        checkpoints. Nothing by default."""
        return {}

    def load_takeover_state(self, meta: Mapping[str, Any]) -> None:  # noqa: B027 - an optional hook
        """Restore ``takeover_state`` read from the board (any value may come): ValueError if it does not
        fit. Nothing by default."""

    def on_parameters_loaded(self) -> None:  # noqa: B027 - an optional hook, empty on purpose
        """The parameter's weights were replaced (a checkpoint, or params restored from the board):
        bring any state derived from them (a target network) in line. Nothing by default."""


def budget_note(config: RLConfig, max_steps: int | None, max_train_count: int | None) -> str | None:
    """The line a run starts with when ``config`` derives settings from its budget (None: it derives none)."""
    derived = config.budget_settings(max_steps, max_train_count)
    if not derived:
        return None
    settings = ", ".join(f"{name} {value}" for name, value in derived.items())
    return f"{config.algorithm}: derived from the run's budget: {settings} (set them to choose)"


def preset_note(config: RLConfig, family: str, env_id: str, values: dict[str, Any]) -> str:
    """The line a run starts with when fields of ``config`` left at None take ``family``'s preset ``values``."""
    settings = ", ".join(f"{name} {value:g}" if isinstance(value, float) else f"{name} {value}"
                         for name, value in values.items())
    return f"{config.algorithm}: the {family} preset for {env_id!r}: {settings} (set them to choose)"
