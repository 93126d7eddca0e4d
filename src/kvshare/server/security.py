"""Who may call the server and how: API key, JSON-only bodies, allowed Host names, CORS.

`AccessPolicy` holds the settings (`kvshare serve --api-key/--allowed-hosts/--cors-origin/
--public-metrics`); `install(app, policy, limits, metrics)` adds the middleware, outermost first:
Host check (DNS rebinding), CORS (only when origins are given; answers preflights), then
`GuardMiddleware` (API key, then Content-Type), then the body limits of `limits`.

* With an API key, every route but /health (and /metrics when `public_metrics`) needs
  ``Authorization: Bearer KEY`` (or ``X-API-Key: KEY``); keys are compared in constant time.
* A POST body must be ``application/json``: a web page cannot send one cross-origin without a
  CORS preflight, which is refused unless its origin is allowed.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field
from typing import Any

from starlette.middleware.cors import CORSMiddleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from kvshare.server.errors import APIError
from kvshare.server.limits import BodyLimitMiddleware, RequestLimits

API_KEY_ENV = "KVSHARE_API_KEY"
OPEN_PATHS = ("/health",)


@dataclass
class AccessPolicy:
    """Access settings of one server; all off by default (the server binds to 127.0.0.1)."""

    api_key: str | None = None
    public_metrics: bool = False
    allowed_hosts: list[str] = field(default_factory=list)
    cors_origins: list[str] = field(default_factory=list)


class GuardMiddleware:
    """401 without the API key (when one is set); 415 for a POST body that is not JSON."""

    def __init__(self, app: ASGIApp, policy: AccessPolicy) -> None:
        self.app = app
        self.open_paths = OPEN_PATHS + (("/metrics",) if policy.public_metrics else ())
        self.key = policy.api_key.encode() if policy.api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if self.key is not None and scope["path"] not in self.open_paths and not self._authorised(headers):
            err = APIError(401, "missing or wrong API key: send `Authorization: Bearer <key>`",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            await err.response()(scope, receive, send)
            return
        if scope["method"] == "POST":
            media = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if media != b"application/json":
                err = APIError(415, f"the request body must be application/json, got "
                                    f"{media.decode('latin-1') or 'no Content-Type'}", code="unsupported_media_type")
                await err.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _authorised(self, headers: dict[bytes, bytes]) -> bool:
        got = headers.get(b"x-api-key")
        auth = headers.get(b"authorization", b"")
        if got is None and auth[:7].lower() == b"bearer ":
            got = auth[7:].strip()
        return got is not None and hmac.compare_digest(got, self.key)  # type: ignore[arg-type]


def install(app: Any, policy: AccessPolicy, limits: RequestLimits, metrics: Any) -> None:
    """Add the access and limit middleware to a FastAPI / Starlette `app` (see the module doc)."""
    app.add_middleware(BodyLimitMiddleware, limits=limits, metrics=metrics)
    app.add_middleware(GuardMiddleware, policy=policy)
    if policy.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(policy.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "X-API-Key"])
    if policy.allowed_hosts:
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(policy.allowed_hosts))
