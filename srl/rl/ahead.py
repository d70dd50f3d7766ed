"""A learner's next batch made ready while the current step runs, and the learner's compute options.

Owns: ``BatchAhead`` (a replay learner's draw — the sample out of its memory and the rows' copy to the
device — run on a side thread one step ahead, on its own CUDA stream) and ``LearnerCompute`` (the
``torch.compile`` and bf16-autocast options of ``RLConfig``, applied the same way by every learner).
Must never: draw more than one batch ahead (the drawn batch's priorities are a step old, no older), let the
main stream read a batch before its copy is done, or hide a draw's error (it is raised by the ``take`` that
would have returned the batch).

Where it pays: on CUDA the device waits for the host between steps — the sum-tree search, the gather of the
rows (a frame memory rebuilds the stacked frames), the pinned copy — unless the next batch is drawn while the
device runs the current one. A replay learner's loop becomes::

    batch = ahead.take()          # drawn during the previous step (the first one now)
    loss(batch) → backward → step → memory.update_priorities(batch's indices)

Drawing ahead does not consume: a replay sample leaves its rows in the memory, so nothing is lost to a batch
drawn and never trained on (the run ended, the trainer died). A segment learner's ``take`` does consume; PPO
and IMPALA draw in line.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np
import torch
from torch import nn

from srl.rl.blocks import to_device
from srl.rl.memories.replay import Sample

if TYPE_CHECKING:
    from srl.base.rl import RLConfig

T = TypeVar("T")


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors a drawn batch holds (itself, a dataclass's fields, a mapping's values, a sequence's items)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from _tensors(getattr(value, f.name))
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


class BatchAhead(Generic[T]):
    """``take()`` returns ``draw()``'s batch; when ``enabled``, the batch drawn on a side thread during the
    previous step, and it starts drawing the next one before returning.

    ``draw`` must be safe beside the caller's step: it may read the memory (which has its own lock) and copy to
    the device (``to_device``), never touch the networks or the optimizer. On CUDA the side thread copies on its
    own stream; ``take`` makes the caller's stream wait for that copy and marks the batch's tensors as used by
    the caller's stream (the allocator keeps their memory until the caller's work on them is done)."""

    def __init__(self, draw: Callable[[], T], device: torch.device, enabled: bool) -> None:
        self.draw = draw
        self.device = device
        self.enabled = enabled
        self._pool: ThreadPoolExecutor | None = None
        self._next: Future[tuple[T, torch.cuda.Event | None]] | None = None
        self._stream: torch.cuda.Stream | None = None
        self._lock = threading.Lock()

    def take(self) -> T:
        if not self.enabled:
            return self.draw()
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="srl-batch-ahead")
                if self.device.type == "cuda":
                    self._stream = torch.cuda.Stream(self.device)
            pending, self._next = self._next, None
            if pending is None:
                batch, event = self._draw_on_side_stream()
            else:  # a draw's error is raised here, where its batch was wanted; the next take draws in line
                batch, event = pending.result()
            self._next = self._pool.submit(self._draw_on_side_stream)
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for tensor in _tensors(batch):
                if tensor.device.type == "cuda":
                    tensor.record_stream(current)
        return batch

    def _draw_on_side_stream(self) -> tuple[T, torch.cuda.Event | None]:
        if self._stream is None:
            return self.draw(), None
        with torch.cuda.stream(self._stream):
            batch = self.draw()
            event = torch.cuda.Event()
            event.record(self._stream)
        return batch, event

    def close(self) -> None:
        """Let the draw under way finish and stop the side thread (``take`` starts it again)."""
        with self._lock:
            pool, self._pool, self._next = self._pool, None, None
        if pool is not None:
            pool.shutdown(wait=True)


@dataclasses.dataclass(frozen=True)
class LearnerCompute:
    """How a learner runs: ``draw_ahead`` (a replay learner's next batch drawn during the current step,
    ``BatchAhead``), ``compile`` (``torch.compile`` of each module's forward, in place, so weights and their names
    stay as they are) and ``bf16`` (forward passes and losses under bf16 autocast; the weights, the gradients and
    the optimizer stay float32). ``of`` reads them from a config (``RLConfig.draw_ahead``, ``torch_compile``,
    ``autocast_bf16``)."""

    device: torch.device
    draw_ahead: bool = False
    compile: bool = False
    bf16: bool = False

    @classmethod
    def of(cls, config: RLConfig, device: torch.device) -> LearnerCompute:
        ahead = config.draw_ahead if config.draw_ahead is not None else device.type == "cuda"
        return cls(device, draw_ahead=ahead, compile=config.torch_compile, bf16=config.autocast_bf16)

    def ahead(self, draw: Callable[[], T]) -> BatchAhead[T]:
        """``draw`` run one step ahead where ``draw_ahead`` says so, else in line."""
        return BatchAhead(draw, self.device, self.draw_ahead)

    def __str__(self) -> str:
        """What is on, for a log line: "draw ahead, torch.compile, bf16 autocast", or "plain"."""
        on = [name for name, flag in (("draw ahead", self.draw_ahead), ("torch.compile", self.compile),
                                      ("bf16 autocast", self.bf16)) if flag]
        return ", ".join(on) or "plain"

    def prepare(self, modules: list[nn.Module]) -> None:
        """Compile the learner's modules (once, when the learner is built)."""
        if self.compile:
            for module in modules:
                module.compile()

    def autocast(self) -> AbstractContextManager[Any]:
        """The context a learner's forward passes and losses run in (backward and the step outside it)."""
        if not self.bf16:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)


@dataclasses.dataclass
class DeviceSample:
    """A replay sample on the learner's device: its columns, importance weights, and the indices and generations
    its priority update needs (on the host)."""

    columns: dict[str, torch.Tensor]
    weights: torch.Tensor
    indices: np.ndarray
    generations: np.ndarray


TRANSITION_COLUMNS = ("obs", "next_obs", "action", "reward", "discount")
"""what a learner of n-step transitions (DQN, SAC) trains on"""


def sample_to_device(sample: Sample, device: torch.device, names: tuple[str, ...] = TRANSITION_COLUMNS
                     ) -> DeviceSample:
    """``sample``'s columns ``names`` and weights copied to ``device`` (``to_device``: pinned, non-blocking)."""
    return DeviceSample({name: to_device(sample.batch[name], device) for name in names},
                        to_device(sample.weights, device), sample.indices, sample.generations)
