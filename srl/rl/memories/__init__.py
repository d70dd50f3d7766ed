"""Buffers: where the trainer keeps experience between arrival and learning.

Owns: the ``Memory`` interface, uniform replay (``ReplayMemory``), proportional
prioritized replay (``ProportionalMemory``), their settings (``MemoryConfig``),
and ``SegmentBuffer`` (segments used once, for on-policy learners).
Must never: block on I/O or know where experience came from; the trainer
decodes batches and hands plain numpy columns in.
"""

from srl.rl.memories.config import MEMORY_KINDS, MemoryConfig
from srl.rl.memories.proportional import ProportionalMemory
from srl.rl.memories.replay import Batch, Memory, ReplayMemory, Sample
from srl.rl.memories.segments import SegmentBuffer

__all__ = [
    "MEMORY_KINDS",
    "Batch",
    "Memory",
    "MemoryConfig",
    "ProportionalMemory",
    "ReplayMemory",
    "Sample",
    "SegmentBuffer",
]
