"""What the HTTP tool adapters share: one httpx client per adapter, and what an exchange saw.

An adapter (`halfway.tools.payments`, `halfway.tools.travel`) reports what it saw and never
raises for a provider or network failure; the pure core (`halfway.core.classify`) decides what
that means. How each failure maps, and why:

- connect refused, connect timeout, no free pooled connection: the request never left → NotSent
- read timeout, write timeout (the request may be partly sent): → TimedOut
- the server hung up, a read or write broke: → ConnectionLost
- any status other than 2xx: → Replied, with the error body's code (or type) and message
  (Stripe's shape, `{"error": {type, code, message}}`)
- anything else → Unexpected
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import TracebackType
from typing import Any, Self

import httpx

from halfway.core.classify import (
    CallFailure,
    ConnectionLost,
    NotSent,
    Replied,
    TimedOut,
    Unexpected,
)
from halfway.tools.spec import CallResult, Succeeded

CONNECT_TIMEOUT_S_MAX = 2.0  # a local or regional API accepts a connection well within this
CONNECTIONS_MAX = 100  # httpx's default pool size, named; waiting for a slot is a PoolTimeout
ERROR_TEXT_CHARS_MAX = 300  # of an unparseable error body, kept in the failure


class HttpAdapter:
    """One shared `httpx.AsyncClient` per adapter, made on first use; `aclose()` closes it
    (closing it again is harmless)."""

    def __init__(self, base_url: str, *, connections_max: int = CONNECTIONS_MAX) -> None:
        self._base_url = base_url.rstrip("/")
        self._limits = httpx.Limits(max_connections=connections_max,
                                    max_keepalive_connections=connections_max)
        self._client: httpx.AsyncClient | None = None

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(base_url=self._base_url, limits=self._limits)
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    async def _request(self, method: str, path: str, timeout_s: float,
                       **kwargs: Any) -> httpx.Response | CallFailure:
        """One exchange, or the failure it ended in, mapped as the module docstring says."""
        try:
            async with asyncio.timeout(attempt_budget_s(timeout_s)):
                return await self._http().request(method, path, timeout=httpx_timeout(timeout_s),
                                                  **kwargs)
        # Order matters only for readability: these httpx classes do not overlap.
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            return NotSent(f"{type(exc).__name__}: {exc}")
        except httpx.PoolTimeout:
            # Waiting for one of our own pooled connections: nothing was written yet.
            return NotSent(f"no free connection within {timeout_s:g} s")
        except httpx.UnsupportedProtocol as exc:
            return NotSent(f"UnsupportedProtocol: {exc}")
        except (httpx.ReadTimeout, httpx.WriteTimeout, TimeoutError):
            # WriteTimeout: part of the request may have reached the server. TimeoutError: our
            # whole-attempt budget ran out (a trickling reply), after the request was sent.
            return TimedOut(timeout_s)
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
            return ConnectionLost(f"{type(exc).__name__}: {exc}")
        except Exception as exc:
            return Unexpected(f"{type(exc).__name__}: {exc}")


def httpx_timeout(timeout_s: float) -> httpx.Timeout:
    return httpx.Timeout(timeout_s, connect=min(timeout_s, CONNECT_TIMEOUT_S_MAX))


def attempt_budget_s(timeout_s: float) -> float:
    """A bound on the whole attempt. httpx's timeouts bound each wait, not their sum; this lets
    one pool wait, connect and read each run their course, and no more."""
    return 2 * timeout_s + min(timeout_s, CONNECT_TIMEOUT_S_MAX)


def error_text(response: httpx.Response) -> str:
    return response.text[:ERROR_TEXT_CHARS_MAX]


def replayed(response: httpx.Response) -> bool:
    """Whether the provider says this answer is a replay of the key's first one."""
    return response.headers.get("Idempotent-Replayed", "").lower() == "true"


def replied(response: httpx.Response) -> Replied:
    """A non-2xx answer, with the error body's code (or type) and message when it has them."""
    again = replayed(response)
    try:
        error = response.json()["error"]
        return Replied(response.status_code, code=error.get("code") or error.get("type"),
                       message=error.get("message") or "", replayed=again)
    except Exception:
        return Replied(response.status_code, code=None, message=error_text(response),
                       replayed=again)


def call_result(response: httpx.Response, done: str,
                evidence_of: Callable[[dict[str, Any]], dict[str, Any]]) -> CallResult:
    """What a provider's answer to a create says: `Succeeded` with evidence when it is 2xx and
    the object it returns is in status `done`; otherwise what it is (a 2xx without a readable
    object, or one not finished yet, is `Unexpected`: never done without evidence)."""
    status = response.status_code
    if 200 <= status < 300:
        try:
            made = response.json()
            evidence = evidence_of(made)
            made_status = made.get("status")
        except Exception as exc:
            # It said yes but not what it did: without evidence this is not done, only unknown.
            return Unexpected(f"HTTP {status} without a readable object "
                              f"({type(exc).__name__}: {exc}): {error_text(response)}")
        if made_status != done:
            # Stripe answers a decline with 402; a 2xx object still pending is not done yet.
            return Unexpected(f"HTTP {status} with {made.get('id')} in status "
                              f"{made_status!r}, not {done!r}")
        return Succeeded(evidence=evidence, replayed=replayed(response))
    return replied(response)
