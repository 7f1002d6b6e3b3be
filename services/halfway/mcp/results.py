"""What an MCP tool call's answer (or its failure) proves. Pure.

A call:

- a normal result: `done`, with the structured content as evidence (else the text content);
- an `isError` result: the tool ran and reported an error, which says nothing about its effect
  unless the app declares the tool's errors are refusals (`errors_are_refusals`): then
  `not_done`, else `unknown`;
- a JSON-RPC error: "method not found" and "invalid params" are the server refusing the request
  before running it (`not_done`); any other code proves nothing (`unknown`);
- a timeout, a dropped session, a transport error after the request was sent: `unknown`;
- no session could be had before sending: "never reached" (`NotSent`).

A lookup (a read-only tool of the same server, called with our key): a normal result with
content is the effect, found; an empty one (no content and a null or empty structured result,
`{"result": null}` as the SDK's servers write a function returning None, or
`{"found": false}`) is "nothing found"; an `isError` result or a failure is a failed lookup,
which says nothing.
"""

from __future__ import annotations

from typing import Any

from mcp.shared.exceptions import MCPError
from mcp_types import (
    CONNECTION_CLOSED,
    INVALID_PARAMS,
    METHOD_NOT_FOUND,
    REQUEST_TIMEOUT,
    CallToolResult,
    TextContent,
)

from halfway.app.functions import ERROR_CHARS_MAX, evidence_of
from halfway.core.classify import (
    CallFailure,
    ConnectionLost,
    TimedOut,
    ToolRefused,
    Unexpected,
)
from halfway.mcp.connection import describe
from halfway.tools.spec import (
    CallResult,
    Found,
    LookupFailed,
    LookupResult,
    NotFound,
    Succeeded,
)

REFUSING_CODES = frozenset({METHOD_NOT_FOUND, INVALID_PARAMS})
TEXT_CHARS_MAX = 4000  # of a text-only result kept as evidence


def text_of(result: CallToolResult) -> str:
    return "\n".join(block.text for block in result.content if isinstance(block, TextContent))


def payload_of(result: CallToolResult) -> Any:
    """The structured content, unwrapped from the SDK's `{"result": X}` for non-object
    returns; else the text content; None when there is neither."""
    structured = result.structured_content
    if structured is not None:
        if isinstance(structured, dict) and set(structured) == {"result"}:
            return structured["result"]
        return structured
    text = text_of(result)
    return {"text": text[:TEXT_CHARS_MAX]} if text else None


def call_result(result: CallToolResult, *, errors_are_refusals: bool) -> CallResult:
    """What a tools/call answer proves about the effect."""
    if result.is_error:
        words = (text_of(result) or "no details")[:ERROR_CHARS_MAX]
        if errors_are_refusals:
            return ToolRefused(words)
        return Unexpected(f"the tool reported an error (isError): {words}")
    payload = payload_of(result)
    return Succeeded(evidence=evidence_of({} if payload is None else payload))


def call_failure(exc: BaseException, timeout_s: float) -> CallFailure:
    """What an exception raised after the request may have left proves."""
    if isinstance(exc, MCPError):
        code, message = exc.error.code, exc.error.message[:ERROR_CHARS_MAX]
        if code == REQUEST_TIMEOUT:
            return TimedOut(timeout_s)
        if code == CONNECTION_CLOSED:
            return ConnectionLost(f"the MCP session closed: {message}")
        if code in REFUSING_CODES:
            return ToolRefused(f"the MCP server rejected the request ({code}): {message}")
        return Unexpected(f"MCP error {code}: {message}")
    if isinstance(exc, TimeoutError):
        return TimedOut(timeout_s)
    return Unexpected(describe(exc))


def lookup_result(result: CallToolResult) -> LookupResult:
    """What a lookup tool's answer says (see the module docstring)."""
    if result.is_error:
        return LookupFailed(f"the lookup tool reported an error: "
                            f"{(text_of(result) or 'no details')[:ERROR_CHARS_MAX]}")
    payload = payload_of(result)
    if payload in (None, {}, [], "") or (isinstance(payload, dict)
                                          and payload.get("found") is False):
        return NotFound("the lookup tool found nothing with this key")
    return Found(evidence=evidence_of(payload))
