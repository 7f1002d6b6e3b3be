"""What the API's handlers share: JSON errors, who a request acts for, and the Host check."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from halfway.api.auth import Principal, Refusal, Scope, Tokens, authorize, host_allowed

ERROR_CHARS_MAX = 500
HOST_QUOTED_CHARS_MAX = 80


@dataclass(frozen=True, slots=True)
class Access:
    """Who may use this API, and by which names it is reached."""

    tokens: Tokens
    dev: bool
    allowed_hosts: frozenset[str]


ACCESS = web.AppKey("access", Access)


def error(kind: type[web.HTTPException], reason: str,
          headers: dict[str, str] | None = None) -> web.HTTPException:
    return kind(text=json.dumps({"error": reason[:ERROR_CHARS_MAX]}),
                content_type="application/json", headers=headers)


def json_ok(data: Any, status: int = 200) -> web.Response:
    return web.json_response(data, status=status, headers={"Cache-Control": "no-store"})


def require(request: web.Request, scope: Scope) -> Principal:
    """The principal the request acts for; 401 or 403 (with `WWW-Authenticate`) when it may
    not do what `scope` allows."""
    access = request.app[ACCESS]
    verdict = authorize(access.tokens, request.headers.get("Authorization"), scope,
                        dev=access.dev)
    if isinstance(verdict, Refusal):
        kind = web.HTTPUnauthorized if verdict.status == 401 else web.HTTPForbidden
        headers = {"WWW-Authenticate": verdict.challenge} if verdict.challenge else None
        raise error(kind, verdict.reason, headers)
    return verdict


@web.middleware
async def check_host(request: web.Request,
                     handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
                     ) -> web.StreamResponse:
    """421 for a Host this API is not (DNS rebinding); checked before anything else."""
    host = request.headers.get("Host")
    if not host_allowed(host, request.app[ACCESS].allowed_hosts):
        shown = (host or "")[:HOST_QUOTED_CHARS_MAX]
        raise error(web.HTTPMisdirectedRequest,
                    f"this API does not answer to the host {shown!r}: the names it answers to "
                    "are set by HALFWAY_API_ALLOWED_HOSTS")
    return await handler(request)


@web.middleware
async def json_route_errors(request: web.Request,
                            handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
                            ) -> web.StreamResponse:
    """No route (404) or no such method (405) under /api/ answers JSON like every other API
    error, not aiohttp's plain text; a 405 keeps its Allow header."""
    unmatched = request.match_info.http_exception
    if unmatched is None or not (request.path + "/").startswith("/api/"):
        return await handler(request)
    if isinstance(unmatched, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(unmatched.allowed_methods))
        raise web.HTTPMethodNotAllowed(
            request.method, unmatched.allowed_methods, content_type="application/json",
            text=json.dumps({"error": f"{request.method[:20]} is not allowed on "
                                      f"{request.path[:100]}; allowed: {allowed}"}))
    raise error(type(unmatched), f"no such endpoint: {request.path[:100]!r} (the endpoints are "
                "in /api/openapi.json)")
