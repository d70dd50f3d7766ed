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
import itertools

import torch
from torch import nn

from srl.base.config import check_int
from srl.base.schema import Column

RECURRENT_KINDS = ("lstm", "gru")
"""the cells a config's ``recurrent`` names"""
MAX_RECURRENT_SIZE = 4096
STATE_C_BOUND = 1e6
"""an LSTM cell state beyond this is refused as a row (it grows by at most 1 a step from 0)"""

CELL_WEIGHTS = ("weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0")
"""the one-layer ``nn.LSTM``/``nn.GRU`` weights the cell op takes, in its order"""

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
    """One LSTM or GRU layer over features (orthogonal weights, zero biases, as CleanRL's LSTM agents).

    Actors ``step`` it (one cell call per env step: the cell op directly, a third of what a one-step
    ``nn.LSTM`` call costs on a CPU); learners ``unroll`` it with torch's fused sequence op, cut only where
    some row's episode begins (six times faster than a loop of cell calls over a 256-step segment on a
    CPU). Both use the same weights."""

    def __init__(self, kind: str, in_features: int, size: int) -> None:
        super().__init__()
        check_recurrent(kind, size)
        self.kind = kind
        self.size = size
        self.rnn: nn.LSTM | nn.GRU = (nn.LSTM(in_features, size, batch_first=True) if kind == "lstm"
                                      else nn.GRU(in_features, size, batch_first=True))
        for name, weight in self.rnn.named_parameters():
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
        weights: list[torch.Tensor] = [getattr(self.rnn, name) for name in CELL_WEIGHTS]
        if c is not None:
            h, c = torch.lstm_cell(x, (h, c), *weights)
            return h, (h, c)
        h = torch.gru_cell(x, h, *weights)
        return h, (h, None)

    def unroll(self, x: torch.Tensor, state: State, resets: torch.Tensor) -> tuple[torch.Tensor, State]:
        """Outputs ``(batch, T, size)`` for features ``x`` ``(batch, T, F)`` from ``state``, the state zeroed
        before step t of a row where ``resets[row, t]`` (an episode began there); and the final state."""
        cuts = resets.any(dim=0)
        cuts[0] = True
        bounds = [*torch.nonzero(cuts).flatten().tolist(), x.shape[1]]
        if x.is_cuda:  # weights loaded or moved leave cuDNN's one block; it would compact them at every call
            self.rnn.flatten_parameters()
        outputs = []
        h, c = state
        for start, stop in itertools.pairwise(bounds):
            keep = (~resets[:, start]).to(x.dtype).unsqueeze(-1)
            h = h * keep
            if c is not None:
                out, (h_n, c_n) = self.rnn(x[:, start:stop], (h.unsqueeze(0), (c * keep).unsqueeze(0)))
                h, c = h_n[0], c_n[0]
            else:
                out, h_n = self.rnn(x[:, start:stop], h.unsqueeze(0))
                h = h_n[0]
            outputs.append(out)
        return torch.cat(outputs, dim=1), (h, c)


def stack_states(states: list[State]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The states of K cores as ``(batch, K, size)`` tensors (the columns' layout)."""
    h = torch.stack([s[0] for s in states], dim=1)
    cs = [s[1] for s in states]
    return h, (None if cs[0] is None else torch.stack([c for c in cs if c is not None], dim=1))


def split_states(h: torch.Tensor, c: torch.Tensor | None) -> list[State]:
    """``stack_states`` undone: K states of ``(batch, size)``."""
    return [(h[:, k], None if c is None else c[:, k]) for k in range(h.shape[1])]
