"""Who a request is, for the caches that outlive it: its tenant, the namespace of the draft's prefix and
per-document caches, the selection memo and the main model's prefix cache (a vLLM main's ``cache_salt``).

A request's tenant is a keyed digest (HMAC-SHA256 under ``tenant_secret``) of the Bearer key it was admitted
with, so each key is its own tenant and the key itself is kept nowhere. With ``tenant_header``, the value of
that header names a tenant within the key's (two keys never share, whatever they declare); the gateway trusts
it as sent, which is right only behind a proxy that authenticates clients and sets it. A gateway without keys
has one tenant (anyone who can reach it is the same client), as does ``cache_scope="shared"``: both use the
shared namespace (None), which is also the engine's own when used by one application.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Mapping

from .errors import GatewayError, bad_request
from .settings import GatewaySettings

MAX_TENANT_CHARS = 128  # a declared tenant's name, at most
_DIGEST_BYTES = 16  # 128 bits: no two tenants' digests meet


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header (the scheme in any case), else None."""
    scheme, _, token = (authorization or "").partition(" ")
    return token.lstrip(" ") if scheme.lower() == "bearer" else None


class Tenancy:
    """A gateway's rule from a request's headers to its tenant (see the module).

    Args:
        keyed: whether the gateway has API keys (the admission checked the request's against them).
        scope: ``"tenant"`` or ``"shared"`` (every request in the shared namespace).
        header: the declared tenant's header, or None.
        secret: the digest's key; None draws a random one (tenants are then this process's own).
    """

    def __init__(self, keyed: bool, scope: str = "tenant", header: str | None = None, secret: bytes | None = None):
        self.keyed = keyed
        self.scope = scope
        self.header = header.lower() if header is not None else None
        self._secret = secret if secret is not None else secrets.token_bytes(32)

    @classmethod
    def of(cls, settings: GatewaySettings) -> Tenancy:
        secret = settings.tenant_secret.get_secret_value().encode() if settings.tenant_secret is not None else None
        return cls(bool(settings.api_keys()), settings.cache_scope, settings.tenant_header, secret)

    def tenant(self, headers: Mapping[str, str]) -> str | None:
        """The tenant of an admitted request with these headers (names in lower case, as Starlette's are), or
        None for the shared namespace. A declared tenant that is empty, longer than :data:`MAX_TENANT_CHARS` or
        not printable ASCII is a 400 naming the header.
        """
        if self.scope == "shared":
            return None
        key = bearer_token(headers.get("authorization")) if self.keyed else None
        declared = self._declared(headers)
        if key is None and declared is None:
            return None
        return self._digest(key or "", declared or "")

    def _declared(self, headers: Mapping[str, str]) -> str | None:
        if self.header is None or self.header not in headers:
            return None
        value = headers[self.header]
        if not 0 < len(value) <= MAX_TENANT_CHARS or not value.isascii() or not value.isprintable():
            raise _bad_tenant(self.header)
        return value

    def _digest(self, key: str, declared: str) -> str:
        message = f"{len(key)}:{key}:{declared}".encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()[: 2 * _DIGEST_BYTES]


def _bad_tenant(header: str) -> GatewayError:
    return bad_request(
        f"the {header} header must name a tenant in 1 to {MAX_TENANT_CHARS} printable ASCII characters; "
        "send such a name, or leave the header out for the tenant of your API key",
        header,
    )
