"""Limit definitions as control events.

The backbone's `events.control.LimitsSet` (tag `limits.set`) is the place for limits; this
module grows it with the fields governance needs, as a subclass with the *same tag* and only
defaulted additions. On the wire it stays one event type: the backbone's decoder reads these
messages (it ignores the extra fields), and `decode_control_event` here reads the backbone's
(the new fields take their defaults). When the backbone adopts the fields, this subclass
collapses into an alias.

The backbone's EventStore appends it on `{prefix}.ctl.limits.<tenant_id>` (one aggregate per
tenant, so conflicting edits of a tenant's limits give a 409). A `LimitsSet` replaces every
limit of one scope — (tenant, optional key, optional SKU) —
so the latest event of a scope is its whole policy. `None` means unlimited.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from events import control

QuotaMetric = Literal["total_tokens", "output_tokens"]


class LimitsSet(control.LimitsSet, tag="limits.set", kw_only=True, frozen=True):
    # The key this policy narrows to (a key of `tenant_id`); None: the whole tenant.
    key_id: str | None = None
    # What `token_quota` counts: prompt + completion tokens, or completion tokens only.
    quota_metric: QuotaMetric = "total_tokens"
    # Spend cap per quota period, a decimal string in `spend_currency` (the price plans').
    spend_cap: str | None = None
    spend_currency: str | None = None
    # Streams (in-flight requests) open at once.
    max_concurrent_streams: int | None = None

    @property
    def scope_id(self) -> str:
        """The id limits are counted against: the key's when narrowed to a key."""
        return self.key_id or self.tenant_id


_decoder = msgspec.json.Decoder(LimitsSet)


def decode_limits(data: bytes) -> LimitsSet:
    """Decode a `limits.set` event (raises msgspec.DecodeError for any other type)."""
    return _decoder.decode(data)
