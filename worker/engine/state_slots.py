"""Slot pool for per-sequence DeltaNet states (recurrent state and conv state share one index).

Unlike KV, these states do not grow with the sequence: a running sequence holds exactly one slot,
so the pool size bounds how many sequences can run at once.
"""

from __future__ import annotations


class StateSlotPool:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError("need at least one state slot")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out low slots first
        self._is_free = [True] * num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("no free state slot")
        slot = self._free.pop()
        self._is_free[slot] = False
        return slot

    def free(self, slot: int) -> None:
        if self._is_free[slot]:
            raise RuntimeError(f"state slot {slot} freed twice")
        self._is_free[slot] = True
        self._free.append(slot)
