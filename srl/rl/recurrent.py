"""The recurrent core: an LSTM (or GRU) between the encoder and the heads, and its state as data.

Owns: ``RecurrentCore`` (one cell, stepped one observation at a time by actors and unrolled over a
stored sequence by learners, with the state reset wherever an episode began), ``state_columns`` (how
the state at a segment's or sequence's start travels: ``state_h`` and, for an LSTM, ``state_c``, both
``(cores, size)`` float32, bounded) and ``check_recurrent``. PPO and IMPALA (``recurrent="lstm"``) and
R2D2 build theirs here. Must never: trust a state it did not check (the columns' bounds do that), or
know an algorithm.

The state an actor had when a row's first step was acted goes with the row; the learner starts its
unroll from it and resets the state before every step whose ``state_reset`` flag says an episode
began there, exactly as the actor did, so a learner with the actor's weights reproduces the actor's
hidden states. Bounds: an LSTM's ``h`` is o * tanh(c) and a GRU's a mix of tanh outputs and its last
``h``, so both lie in [-1, 1]; an LSTM's cell ``c`` grows by at most 1 a step (f c + i g, |g| < 1,
0 < f, i < 1), so ``STATE_C_BOUND`` holds any episode shorter than a million steps.
"""

from __future__ import annotations

import difflib

import numpy as np
import torch
from torch import nn

from srl.base.config import check_int
from srl.base.schema import Column

RECURRENT_KINDS = ("lstm", "gru")
"""the cells a config's ``recurrent`` names"""
MAX_RECURRENT_SIZE = 4096
STATE_C_BOUND = 1e6
"""an LSTM cell state beyond this is refused as a row (it grows by at most 1 a step from 0)"""

State = tuple[torch.Tensor, torch.Tensor | None]
"""``(h, c)``, each ``(batch, size)``; ``c`` is None for a GRU"""


def check_recurrent(kind: str | None, size: int) -> None:
    """ValueError unless ``kind`` is None or one of ``RECURRENT_KINDS`` and ``size`` a sane width."""
    if kind is not None and kind not in RECURRENT_KINDS:
        close = difflib.get_close_matches(str(kind)[:64], RECURRENT_KINDS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"recurrent must be one of {list(RECURRENT_KINDS)} or None (feed-forward), got "
                         f"{str(kind)[:40]!r}{hint}")
    check_int("recurrent_size", size, 1, MAX_RECURRENT_SIZE)


def state_columns(kind: str, cores: int, size: int) -> dict[str, Column]:
    """The columns of the state at a row's start (see the module docstring)."""
    columns = {"state_h": Column("float32", (cores, size), low=-1.0, high=1.0)}
    if kind == "lstm":
        columns["state_c"] = Column("float32", (cores, size), low=-STATE_C_BOUND, high=STATE_C_BOUND)
    return columns


class RecurrentCore(nn.Module):
    """One LSTM or GRU cell over features (orthogonal weights, zero biases, as CleanRL's LSTM agents)."""

    def __init__(self, kind: str, in_features: int, size: int) -> None:
        super().__init__()
        check_recurrent(kind, size)
        self.kind = kind
        self.size = size
        self.cell: nn.LSTMCell | nn.GRUCell = (
            nn.LSTMCell(in_features, size) if kind == "lstm" else nn.GRUCell(in_features, size))
        for name, weight in self.cell.named_parameters():
            if name.startswith("weight"):
                nn.init.orthogonal_(weight, 1.0)
            else:
                nn.init.constant_(weight, 0.0)

    def initial(self, batch: int, device: torch.device) -> State:
        h = torch.zeros(batch, self.size, device=device)
        return h, (torch.zeros_like(h) if self.kind == "lstm" else None)

    def step(self, x: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        """One step for a batch: the output (the new ``h``) and the new state."""
        h, c = state
        if isinstance(self.cell, nn.LSTMCell):
            assert c is not None
            h, c = self.cell(x, (h, c))
            return h, (h, c)
        h = self.cell(x, h)
        return h, (h, None)

    def unroll(self, x: torch.Tensor, state: State, resets: torch.Tensor) -> tuple[torch.Tensor, State]:
        """Outputs ``(batch, T, size)`` for features ``x`` ``(batch, T, F)`` from ``state``, the state zeroed
        before step t of a row where ``resets[row, t]`` (an episode began there); and the final state."""
        keep = (~resets).to(x.dtype).unsqueeze(-1)
        outputs = []
        h, c = state
        for t in range(x.shape[1]):
            h = h * keep[:, t]
            if c is not None:
                c = c * keep[:, t]
            out, (h, c) = self.step(x[:, t], (h, c))
            outputs.append(out)
        return torch.stack(outputs, dim=1), (h, c)


def stack_states(states: list[State]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The states of K cores as ``(batch, K, size)`` tensors (the columns' layout)."""
    h = torch.stack([s[0] for s in states], dim=1)
    cs = [s[1] for s in states]
    return h, (None if cs[0] is None else torch.stack([c for c in cs if c is not None], dim=1))


def split_states(h: torch.Tensor, c: torch.Tensor | None) -> list[State]:
    """``stack_states`` undone: K states of ``(batch, size)``."""
    return [(h[:, k], None if c is None else c[:, k]) for k in range(h.shape[1])]


def zero_rows(array: np.ndarray, rows: np.ndarray) -> None:
    """Zero the state of the envs ``rows`` (an episode starts there)."""
    array[rows] = 0.0
