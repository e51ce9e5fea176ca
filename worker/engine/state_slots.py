"""Slot pool for per-sequence DeltaNet states (recurrent state and conv state share one index).

Unlike KV, these states do not grow with the sequence: a running sequence holds exactly one slot,
so the pool size bounds how many sequences can run at once.
"""

from __future__ import annotations

from collections import OrderedDict


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


class StateCheckpoints:
    """Prefix caching's DeltaNet state checkpoints: `num_slots` cache state slots (ids `first`
    onwards, past the running sequences' slots and the scratch slot), each holding one copy of
    a sequence's recurrent and conv state after a block-aligned prefix, keyed by that prefix's
    chain hash (BlockManager). A budget of its own: when full, the least recently used
    checkpoint is overwritten. A hit copies the checkpoint into the sequence's own slot, so a
    checkpoint is never held and may be evicted at any step."""

    def __init__(self, first: int, num_slots: int) -> None:
        self.first, self.num_slots = first, num_slots
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # chain hash -> slot, LRU first
        self._free = list(range(first + num_slots - 1, first - 1, -1))

    def __len__(self) -> int:
        return len(self._slot_of)

    def get(self, prefix_hash: int) -> int | None:
        """The slot of the checkpoint after prefix `prefix_hash`, marked recently used."""
        slot = self._slot_of.get(prefix_hash)
        if slot is not None:
            self._slot_of.move_to_end(prefix_hash)
        return slot

    def __contains__(self, prefix_hash: int) -> bool:
        return prefix_hash in self._slot_of

    def put(self, prefix_hash: int) -> int | None:
        """A slot to copy the state after prefix `prefix_hash` into (a free one, else the least
        recently used checkpoint's); None when that prefix has one already or there are none."""
        if not self.num_slots or prefix_hash in self._slot_of:
            return None
        if self._free:
            slot = self._free.pop()
        else:
            _, slot = self._slot_of.popitem(last=False)
        self._slot_of[prefix_hash] = slot
        return slot
