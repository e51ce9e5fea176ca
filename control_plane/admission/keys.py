"""Who is calling and what they may call, from the in-memory governance view (which follows
the control stream live, so a revoked key or suspended tenant is refused as soon as its event
is applied; the hot path never waits on Postgres)."""

from __future__ import annotations

from dataclasses import dataclass

from control_plane.admin.services import hash_key
from control_plane.admission.view import ApiKey, GovernanceView, Sku, Tenant
from control_plane.dataplane import errors


@dataclass(frozen=True, slots=True)
class Caller:
    tenant: Tenant
    key: ApiKey


# Keys whose hash is remembered (`Authorizer._hashes`); past it the memo starts over.
KEY_HASH_MEMO = 4096
# A longer bearer is refused unhashed (a tokenmill key is 55 characters).
MAX_BEARER_CHARS = 256


class Authorizer:
    def __init__(self, view: GovernanceView) -> None:
        self.view = view
        # key -> sha256, for keys that existed when first seen: a caller's key is hashed once,
        # not on every request (whether the key and its tenant are active is read from the
        # view every time). Only known keys go in, so traffic with made-up keys neither grows
        # it nor evicts real ones; each entry is at most MAX_BEARER_CHARS long.
        self._hashes: dict[str, str] = {}

    def caller(self, authorization: str | None) -> Caller:
        """401 for a missing, unknown or revoked key; 403 for a suspended tenant."""
        if not authorization:
            raise errors.invalid_api_key()
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token or len(token) > MAX_BEARER_CHARS:
            raise errors.invalid_api_key()
        key_hash = self._hashes.get(token)
        known = key_hash is not None
        if key_hash is None:
            # A header is decoded as latin-1, which cannot fail; a non-ASCII key exists nowhere.
            key_hash = hash_key(token) if token.isascii() else ""
        key = self.view.key_by_hash(key_hash)
        if key is None or not key.active:
            raise errors.invalid_api_key()
        if not known:
            if len(self._hashes) >= KEY_HASH_MEMO:
                self._hashes.clear()
            self._hashes[token] = key_hash
        tenant = self.view.tenant(key.tenant_id)
        if tenant is None:
            raise errors.invalid_api_key()
        if not tenant.active:
            raise errors.tenant_suspended()
        return Caller(tenant, key)

    def sku(self, caller: Caller, model: str) -> Sku:
        """The SKU a `model` names (its SKU name, or else the model it serves): 404 if none is
        published, 403 if the key's scopes exclude it."""
        sku = self.view.sku_by_name(model)
        if sku is None or not sku.active:
            candidates = [s for s in self.view.skus() if s.active and s.model == model]
            allowed = [s for s in candidates if caller.key.allows(s.name)]
            if not candidates:
                raise errors.model_not_found(model)
            if not allowed:
                raise errors.model_not_allowed(model)
            return allowed[0]
        if not caller.key.allows(sku.name):
            raise errors.model_not_allowed(model)
        return sku

    def models(self, caller: Caller) -> list[Sku]:
        return [s for s in self.view.skus() if s.active and caller.key.allows(s.name)]
