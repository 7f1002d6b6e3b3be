"""Logging: structlog, JSON lines, with task and step ids bound wherever they are known.

In a terminal the same events render for people; anywhere else (services, CI) one JSON object
per line. `bound(task_id=..., step_id=...)` binds ids for everything logged inside it,
including by code that does not know them.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections import Counter
from contextvars import ContextVar, Token
from typing import Any

import structlog

_configured = False


class _Stderr:
    """Whatever sys.stderr is at the time of writing (pytest swaps it; a fixed handle would
    outlive the capture it points at)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure(*, json: bool | None = None, level: str | None = None) -> None:
    """Configure structlog and the stdlib root logger (aiokafka logs through it) once."""
    global _configured
    if json is None:
        json = os.environ.get("HALFWAY_LOG_FORMAT", "").lower() == "json" or not sys.stderr.isatty()
    level_no = logging.getLevelName((level or os.environ.get("HALFWAY_LOG_LEVEL", "INFO")).upper())
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        _merge_bound,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: Any = (structlog.processors.JSONRenderer() if json
                     else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()))
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer] if json
        else [*shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(level_no),
        # One write per line (print() writes the line, then its newline): processes sharing a
        # terminal or a file never glue another's line onto the end of one of ours.
        logger_factory=structlog.WriteLoggerFactory(file=_Stderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=True,
    )
    # Libraries log through the stdlib: route them through the same renderer.
    handler = logging.StreamHandler(_Stderr())  # type: ignore[arg-type]
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
    ))
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(max(level_no, logging.WARNING) if level is None else level_no)
    _configured = True


def get(name: str | None = None, **bound: Any) -> structlog.typing.FilteringBoundLogger:
    if not _configured:
        configure()
    logger = structlog.get_logger(name) if name else structlog.get_logger()
    return logger.bind(**bound) if bound else logger


class Throttled:
    """Warnings at most one per `interval_s` per key, each saying how many of that key went
    unlogged since (`unlogged_since`): a flood of bad requests writes a line an interval, not
    one per request. The keys are a few names of the caller's (kinds of refusal)."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._logged_s: dict[str, float] = {}  # monotonic
        self._unlogged: Counter[str] = Counter()

    def warning(self, logger: Any, key: str, event: str, **fields: Any) -> None:
        now_s = time.monotonic()
        last_s = self._logged_s.get(key)
        if last_s is not None and now_s - last_s < self.interval_s:
            self._unlogged[key] += 1
            return
        self._logged_s[key] = now_s
        logger.warning(event, unlogged_since=self._unlogged.pop(key, 0), **fields)


# The ids bound by `bound`, as one mapping (never changed in place: each block sets a new one).
# One context variable, set once per block: structlog's bound_contextvars sets one per id,
# and a worker binds ids several times a step (it was 2% of its CPU).
_IDS: ContextVar[dict[str, Any]] = ContextVar("halfway_log_ids", default={})  # noqa: B039


class _Bound:
    __slots__ = ("_ids", "_token")

    def __init__(self, ids: dict[str, Any]) -> None:
        self._ids = ids
        self._token: Token[dict[str, Any]] | None = None

    def __enter__(self) -> None:
        if self._ids:
            self._token = _IDS.set({**_IDS.get(), **self._ids})

    def __exit__(self, *exc: object) -> None:
        if self._token is not None:
            _IDS.reset(self._token)


def bound(**ids: Any) -> _Bound:
    """Bind ids (task_id, step_id, ...) to every log line written inside the block."""
    return _Bound({k: v for k, v in ids.items() if v})


def _merge_bound(_logger: Any, _method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    """The bound ids into a log line (what the line says itself comes first)."""
    for key, value in _IDS.get().items():
        event_dict.setdefault(key, value)
    return event_dict
