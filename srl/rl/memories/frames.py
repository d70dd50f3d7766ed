"""Stacked frames sent and stored once: frame rows, the writer that makes them and the frame replay.

A stacked observation (Atari's last 4 frames) shares all but one frame with the observation before it.
Rows of stacks would send and keep every frame 4 times, and twice more for ``next_obs``. Here a row is
one *frame* of one env's stream instead, and a transition is attached to the row of its observation's
newest frame. The stack of the observation whose newest frame is row ``r`` is rows ``r-S+1 .. r``
(S: the stack size), where rows before the episode's first frame are that frame again (gymnasium's
``FrameStackObservation`` pads a reset's stack with copies of the reset frame).

Owns: the frame-row columns (``frame_row_columns``) and the check that a batch of them is whole
(``frame_rows_problem``: every stack and every ``next_obs`` it refers to lies in the batch, in its own
stream and episode), ``stack_rows`` (which rows make each row's stack), ``FrameWriter`` (a worker's
streams: it turns stacks into frame rows, a batch self-contained: each env's rows start at the first
frame of an episode or with the S-1 frames before the first observation it needs) and
``FrameMemory`` (a replay memory that keeps each frame once in a ring, the transitions in an inner
``Memory`` with the frames' absolute indices, and rebuilds ``obs`` and ``next_obs`` stacks when
sampled). Must never: trust a batch's references (a reference outside its batch is refused by the
schema before the rows reach a memory), or hand out views into the ring.

Frame row columns: ``frame`` (H, W), ``first`` (an episode starts with this frame: a reset stack),
``stream_start`` (an env's rows start here; nothing refers across it), ``transition`` (a transition is
attached: its ``action``, ``reward``, ``discount``, ``version`` and ``next_ahead``, the rows from here to
the newest frame of its ``next_obs``), and the transition's fields (zero on other rows).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from srl.base.schema import Column
from srl.rl.memories.replay import Batch, Memory, Sample

FRAME_FIELDS = ("frame", "first", "stream_start", "transition", "next_ahead")
"""the frame-row columns besides a transition's own"""


def frame_row_columns(frame_shape: tuple[int, ...], frame_dtype: str, n_step: int) -> dict[str, Column]:
    low, high = (0, 255) if frame_dtype == "uint8" else (None, None)
    return {
        "frame": Column(frame_dtype, frame_shape, low, high),
        "first": Column("bool", ()),
        "stream_start": Column("bool", ()),
        "transition": Column("bool", ()),
        "next_ahead": Column("int64", (), low=0, high=n_step),
    }


def stack_rows(first: np.ndarray, stream_start: np.ndarray, stack: int) -> tuple[np.ndarray, np.ndarray]:
    """``(rows, whole)``: for each row, the ``stack`` row indices of the stack whose newest frame it is
    (oldest first; rows before its episode's first frame are that frame again), and whether the batch holds
    all of them (its episode's first frame, or ``stack - 1`` rows before it in its stream)."""
    n = len(first)
    index = np.arange(n, dtype=np.int64)
    last_first = np.maximum.accumulate(np.where(first, index, -1)) if n else index
    last_start = np.maximum.accumulate(np.where(stream_start, index, -1)) if n else index
    oldest = index - (stack - 1)
    in_episode = last_first >= last_start  # the episode's first frame is in this stream's rows
    floor = np.where(in_episode, last_first, oldest)
    rows = np.maximum(oldest[:, None] + np.arange(stack, dtype=np.int64), floor[:, None])
    whole = (last_start >= 0) & (in_episode | (oldest >= last_start))
    return rows, whole


def check_stacks(before: np.ndarray, after: np.ndarray, starting: np.ndarray) -> None:
    """Each env's stack ``after`` (``(E, stack, *frame)``) is ``before`` moved by one frame, or, where
    ``starting``, copies of one frame (an episode's first): what sending each frame once relies on."""
    going = ~starting
    if going.any() and not np.array_equal(after[going, :-1], before[going, 1:]):
        raise RuntimeError("sending each frame once needs stacks that slide by one frame a step; this env's do "
                           "not (set store_frames_once=False)")
    if starting.any() and not (after[starting] == after[starting, -1:]).all():
        raise RuntimeError("sending each frame once needs an episode's first stack to be copies of its reset "
                           "frame (gymnasium's FrameStackObservation with padding_type='reset')")


def frame_rows_problem(columns: Mapping[str, np.ndarray], stack: int) -> str | None:
    """Why these frame rows are not whole (see the module docstring), or None."""
    n = len(columns["frame"])
    if n == 0:
        return None
    first, start, transition = columns["first"], columns["stream_start"], columns["transition"]
    ahead = columns["next_ahead"]
    if not start[0]:
        return "frame rows must begin a stream (stream_start on the first row)"
    if (ahead[~transition] != 0).any():
        return "next_ahead is set on a row without a transition"
    rows = np.flatnonzero(transition)
    if len(rows) == 0:
        return None
    if (ahead[rows] < 1).any():
        return "a transition's next_ahead must be at least 1"
    _, whole = stack_rows(first, start, stack)
    nxt = rows + ahead[rows]
    if (nxt >= n).any():
        return "a transition's next observation lies past the end of the batch"
    # the next observation is in the same stream and episode: no stream or episode starts after the row
    starts = np.cumsum(start | first)
    if (starts[nxt] != starts[rows]).any():
        return "a transition's next observation lies in another stream or episode"
    if not (whole[rows].all() and whole[nxt].all()):
        return "a transition's stack reaches before the frames its stream holds"
    return None


class FrameWriter:
    """One stream of frames per env, turned into self-contained frame rows (see the module docstring).

    The worker calls ``start`` at an episode's first observation, ``step`` with each next observation
    (both checked by ``check_stacks`` first), and ``transition`` when one is complete; ``take`` returns the
    rows.
    """

    def __init__(self, num_envs: int, stack: int, lookback: int) -> None:
        self.stack = stack
        self.lookback = lookback
        """steps a transition may reach back from the newest frame (n-step): kept between takes"""
        self._frames: list[list[np.ndarray]] = [[] for _ in range(num_envs)]
        self._first: list[list[bool]] = [[] for _ in range(num_envs)]
        self._base = [0] * num_envs  # the absolute index of each stream's oldest kept frame
        self._pending: list[list[tuple[int, int, int, float, float, int, list[float]]]] = [
            [] for _ in range(num_envs)]
        self._count = 0

    def newest(self, env: int) -> int:
        """The absolute index of env ``env``'s newest frame (its current observation)."""
        return self._base[env] + len(self._frames[env]) - 1

    def start(self, env: int, obs: np.ndarray) -> int:
        """An episode starts with the stack ``obs`` (copies of its reset frame); its absolute index."""
        self._frames[env].append(np.array(obs[-1]))
        self._first[env].append(True)
        return self.newest(env)

    def step(self, env: int, next_obs: np.ndarray) -> int:
        """The stack ``next_obs`` followed the env's last one: its newest frame joins the stream; its absolute
        index."""
        self._frames[env].append(np.array(next_obs[-1]))
        self._first[env].append(False)
        return self.newest(env)

    def transition(self, env: int, obs: int, next_obs: int, action: int, reward: float, discount: float,
                   version: int, priority: list[float]) -> None:
        """A transition from the stack whose newest frame is ``obs`` to the one of ``next_obs`` (absolute
        indices); ``priority[-1]`` is its initial priority by the time rows are taken."""
        self._pending[env].append((obs, next_obs, action, reward, discount, version, priority))
        self._count += 1

    def pending(self) -> int:
        return self._count

    def take(self) -> dict[str, np.ndarray] | None:
        """The pending transitions with the frames they need, env by env, and their initial priorities (a
        ``priority`` column, 0 on rows without a transition: not one the schema sends); None when there are
        none."""
        if not self._count:
            return None
        parts: list[dict[str, np.ndarray]] = []
        for env, pending in enumerate(self._pending):
            if pending:
                parts.append(self._rows(env, pending))
                pending.clear()
            self._trim(env)
        self._count = 0
        return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}

    def _rows(self, env: int, pending: list[tuple[int, int, int, float, float, int, list[float]]]
              ) -> dict[str, np.ndarray]:
        base, frames, first = self._base[env], self._frames[env], self._first[env]
        low = min(p[0] for p in pending)
        high = max(p[1] for p in pending)
        start = max(low - (self.stack - 1), base)
        # an episode that starts within the stack's reach begins the rows at its first frame
        for index in range(start, low + 1):
            if first[index - base]:
                start = index
                break
        n = high - start + 1
        rows: dict[str, np.ndarray] = {
            "frame": np.stack(frames[start - base : high - base + 1]),
            "first": np.array(first[start - base : high - base + 1], dtype=bool),
            "stream_start": np.zeros(n, bool),
            "transition": np.zeros(n, bool),
            "next_ahead": np.zeros(n, np.int64),
            "action": np.zeros(n, np.int64),
            "reward": np.zeros(n, np.float32),
            "discount": np.zeros(n, np.float32),
            "version": np.zeros(n, np.int64),
            "priority": np.zeros(n, np.float32),
        }
        rows["stream_start"][0] = True
        for obs, next_obs, action, reward, discount, version, priority in pending:
            r = obs - start
            rows["priority"][r] = priority[-1]
            rows["transition"][r] = True
            rows["next_ahead"][r] = next_obs - obs
            rows["action"][r], rows["reward"][r] = action, reward
            rows["discount"][r], rows["version"][r] = discount, version
        return rows

    def _trim(self, env: int) -> None:
        """Keep what later transitions may need: the frames back to the stack of the oldest observation a
        transition not yet made can start from (``lookback`` steps back from the newest)."""
        keep_from = max(self._base[env], self.newest(env) - self.lookback - (self.stack - 1))
        drop = keep_from - self._base[env]
        if drop > 0:
            del self._frames[env][:drop]
            del self._first[env][:drop]
            self._base[env] = keep_from


def stacks_of(columns: Mapping[str, np.ndarray], stack: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(rows, obs, next_obs)``: the transition rows of whole frame rows and their stacks rebuilt
    (``(n, stack, *frame)`` each), as a worker computes initial priorities from what it sends."""
    sources, _ = stack_rows(columns["first"], columns["stream_start"], stack)
    rows = np.flatnonzero(columns["transition"])
    frames = columns["frame"]
    return rows, frames[sources[rows]], frames[sources[rows + columns["next_ahead"][rows]]]


class FrameMemory(Memory):
    """A replay memory of frame rows: each frame once in a ring, each transition in ``inner`` with the
    absolute indices of its stacks' frames; ``sample`` rebuilds ``obs`` and ``next_obs``.

    The ring holds ``frame_capacity`` frames, a few more than ``inner``'s transitions (a batch sends some
    frames twice: the stacks its first observations reach back to); a transition whose frames the ring
    has overwritten is never sampled (its priority drops to zero; a uniform memory draws again).
    """

    def __init__(self, inner: Memory, stack: int, frame_shape: tuple[int, ...], frame_dtype: str,
                 frame_capacity: int) -> None:
        self.inner = inner
        self.capacity = inner.capacity
        self.stack = stack
        self.frame_capacity = frame_capacity
        self._frames = np.empty((frame_capacity, *frame_shape), dtype=frame_dtype)
        self._written = 0  # frames ever written; frame i sits in slot i % frame_capacity
        self._lock = threading.Lock()

    def add(self, batch: Batch, priorities: np.ndarray | None = None) -> None:
        sources, _ = stack_rows(batch["first"], batch["stream_start"], self.stack)
        rows = np.flatnonzero(batch["transition"])
        frames = batch["frame"]
        with self._lock:
            base = self._written
            n = len(frames)
            kept = min(n, self.frame_capacity)
            start = (base + n - kept) % self.frame_capacity
            first = min(kept, self.frame_capacity - start)  # two slices at most: memory copies, no gather
            self._frames[start:start + first] = frames[n - kept:n - kept + first]
            self._frames[:kept - first] = frames[n - kept + first:]
            self._written += n
        if len(rows) == 0:
            return
        transitions = {
            "obs_frames": base + sources[rows],
            "next_frames": base + sources[rows + batch["next_ahead"][rows]],
            **{name: batch[name][rows] for name in ("action", "reward", "discount", "version")},
        }
        self.inner.add(transitions, None if priorities is None else priorities[rows])

    def sample(self, batch_size: int) -> Sample:
        sample = self.inner.sample(batch_size)
        for _ in range(8):
            with self._lock:
                floor = self._written - self.frame_capacity
                gone = sample.batch["obs_frames"][:, 0] < floor
                if not gone.any():
                    obs = self._frames[sample.batch["obs_frames"] % self.frame_capacity]
                    next_obs = self._frames[sample.batch["next_frames"] % self.frame_capacity]
                    break
            # transitions whose frames were overwritten: never again (proportional), and draw others
            self.inner.forget(sample.indices[gone], sample.generations[gone])
            again = self.inner.sample(int(gone.sum()))
            for name in sample.batch:
                sample.batch[name][gone] = again.batch[name]
            sample.indices[gone], sample.weights[gone] = again.indices, again.weights
            sample.generations[gone] = again.generations
        else:
            raise RuntimeError("the replay's frame ring is too small for its transitions: most sampled "
                               "transitions have lost their frames")
        batch = {name: sample.batch[name] for name in ("action", "reward", "discount", "version")}
        batch["obs"], batch["next_obs"] = obs, next_obs
        return Sample(batch, sample.indices, sample.weights, sample.generations)

    def update_priorities(self, indices: np.ndarray, priorities: np.ndarray,
                          generations: np.ndarray | None = None) -> None:
        self.inner.update_priorities(indices, priorities, generations)

    def __len__(self) -> int:
        return len(self.inner)

    @property
    def total_added(self) -> int:
        return self.inner.total_added

    @property
    def beta(self) -> float:
        return self.inner.beta

    @property
    def nbytes(self) -> int:
        return int(self._frames.nbytes) + self.inner.nbytes

    def state_nbytes(self) -> int:
        held = min(self._written, self.frame_capacity)
        return held * int(self._frames[0].nbytes) + (self.inner.state_nbytes() or 0)

    def state_arrays(self) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
        inner = self.inner.state_arrays()
        if inner is None:
            return None
        arrays, meta = inner
        with self._lock:
            held = min(self._written, self.frame_capacity)
            first = self._written - held
            slots = (first + np.arange(held)) % self.frame_capacity
            arrays = {**arrays, "frames": self._frames[slots]}
            return arrays, {**meta, "frames_written": self._written, "frame_capacity": self.frame_capacity}

    def load_state_arrays(self, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> None:
        written, capacity = meta.get("frames_written"), meta.get("frame_capacity")
        frames = arrays.get("frames")
        if not isinstance(written, int) or capacity != self.frame_capacity or frames is None:
            raise ValueError(f"the saved memory's frame ring ({capacity!r} frames) is not this one's "
                             f"({self.frame_capacity})")
        if frames.shape[1:] != self._frames.shape[1:] or frames.dtype != self._frames.dtype \
                or len(frames) != min(written, self.frame_capacity):
            raise ValueError(f"the saved frames {frames.shape} {frames.dtype} do not fit this memory's "
                             f"{self._frames.shape[1:]} {self._frames.dtype}")
        self.inner.load_state_arrays({k: v for k, v in arrays.items() if k != "frames"}, meta)
        with self._lock:
            first = written - len(frames)
            self._frames[(first + np.arange(len(frames))) % self.frame_capacity] = frames
            self._written = written
