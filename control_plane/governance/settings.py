"""Governance settings, read from the environment once (defaults suit one machine)."""

from __future__ import annotations

from dataclasses import dataclass, field

from control_plane.settings import env, env_float


@dataclass(frozen=True)
class GovernanceSettings:
    # TOKENMILL_GOV_DEFAULT_MAX_TOKENS: what a request without max_tokens reserves (and is
    # capped to): its completion can never outgrow what admission reserved.
    default_max_tokens: int = field(
        default_factory=lambda: int(env_float("TOKENMILL_GOV_DEFAULT_MAX_TOKENS", 4096))
    )
    # TOKENMILL_GOV_RESERVATION_TTL_S: the longest a request may run. A quota reservation whose
    # request never shows up in the usage stream is dropped after this; so is what a crashed
    # replica held.
    reservation_ttl_s: float = field(
        default_factory=lambda: env_float("TOKENMILL_GOV_RESERVATION_TTL_S", 600.0)
    )
    # TOKENMILL_GOV_STREAM_TTL_S: a crashed replica's concurrent-stream slots free after this.
    stream_slot_ttl_s: float = field(
        default_factory=lambda: env_float("TOKENMILL_GOV_STREAM_TTL_S", 30.0)
    )
    # TOKENMILL_GOV_SYNC_INTERVAL_S: how often a replica hands back idle leased budget and
    # refreshes its heartbeat in the shared counters.
    sync_interval_s: float = field(
        default_factory=lambda: env_float("TOKENMILL_GOV_SYNC_INTERVAL_S", 0.25)
    )
    # TOKENMILL_GOV_IDLE_RETURN_S: leased budget unused this long goes back to the pool.
    idle_return_s: float = field(
        default_factory=lambda: env_float("TOKENMILL_GOV_IDLE_RETURN_S", 1.0)
    )
    # TOKENMILL_GOV_LEASE_FRACTION: the largest lease, as a fraction of the limit. Smaller
    # leases strand less budget on an idle replica; larger ones hit NATS less often.
    lease_fraction: float = field(
        default_factory=lambda: env_float("TOKENMILL_GOV_LEASE_FRACTION", 0.02)
    )
    # TOKENMILL_GOV_FOLLOWER_HEARTBEAT_S: the usage follower's idle heartbeat. Three missed
    # (a NATS restart, a lost node) and it re-creates its consumer from the last sequence read.
    follower_heartbeat_s: float = field(
        default_factory=lambda: env_float("TOKENMILL_GOV_FOLLOWER_HEARTBEAT_S", 1.0)
    )
    # TOKENMILL_STREAM_REPLICAS: replicas of the shared-budget KV buckets, as for the streams.
    kv_replicas: int = field(default_factory=lambda: int(env("TOKENMILL_STREAM_REPLICAS", "1")))
