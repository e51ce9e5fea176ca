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
    a sequence's recurrent and conv state after a block-aligned prefix.

    A slot is either keyed (by that prefix's chain hash, BlockManager) or held by one running
    sequence as its tail checkpoint: the state at its deepest block boundary so far, copied
    again each time the sequence reaches a deeper one and keyed once the sequence stops
    running (`bind`), when every token before it is known. Keyed checkpoints are an LRU: when
    no slot is free, the least recently used one is overwritten. Held slots are never
    overwritten, and at most half the pool is held, so keyed checkpoints always have room. A
    hit copies the checkpoint into the sequence's own slot, so a keyed checkpoint may be evicted
    at any step."""

    def __init__(self, first: int, num_slots: int) -> None:
        self.first, self.num_slots = first, num_slots
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # chain hash -> slot, LRU first
        self._free = list(range(first + num_slots - 1, first - 1, -1))
        self._held: set[int] = set()
        self.max_held = num_slots // 2
        self.num_evicted = 0  # keyed checkpoints overwritten to make room

    def __len__(self) -> int:
        return len(self._slot_of)

    @property
    def num_held(self) -> int:
        return len(self._held)

    def get(self, prefix_hash: int) -> int | None:
        """The slot of the checkpoint after prefix `prefix_hash`, marked recently used."""
        slot = self._slot_of.get(prefix_hash)
        if slot is not None:
            self._slot_of.move_to_end(prefix_hash)
        return slot

    def __contains__(self, prefix_hash: int) -> bool:
        return prefix_hash in self._slot_of

    def _take(self) -> int | None:
        if self._free:
            return self._free.pop()
        if self._slot_of:
            self.num_evicted += 1
            return self._slot_of.popitem(last=False)[1]
        return None

    def put(self, prefix_hash: int) -> int | None:
        """A slot to copy the state after prefix `prefix_hash` into (a free one, else the least
        recently used checkpoint's); None when that prefix has one already or there are none."""
        if not self.num_slots or prefix_hash in self._slot_of:
            return None
        slot = self._take()
        if slot is not None:
            self._slot_of[prefix_hash] = slot
        return slot

    def hold(self) -> int | None:
        """An unkeyed slot for a running sequence's tail checkpoint (a free one, else the least
        recently used checkpoint's); None when half the pool is held already."""
        if len(self._held) >= self.max_held:
            return None
        slot = self._take()
        if slot is not None:
            self._held.add(slot)
        return slot

    def bind(self, slot: int, prefix_hash: int) -> None:
        """Key held `slot` by the prefix whose state it holds (the most recently used); freed
        instead when that prefix has a checkpoint already."""
        if prefix_hash in self._slot_of:
            self.release(slot)
            return
        self._held.remove(slot)
        self._slot_of[prefix_hash] = slot

    def release(self, slot: int) -> None:
        """Give back held `slot` unkeyed (its state matches no known prefix)."""
        self._held.remove(slot)
        self._free.append(slot)
