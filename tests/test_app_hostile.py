"""The app API against hostile tools and declarations, without a broker.

What a tool or lookup returns or raises, and what its author declares, must never stop the
process, break the journal, or prove more than it shows: a lookup's garbage is not "nothing
found", evidence always fits the journal, and a declaration out of range fails at import.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from pydantic import BaseModel
from pydantic_core import to_json

from halfway import App, Refused
from halfway.app.functions import EVIDENCE_BYTES_MAX, FIELDS_KEPT_MAX, evidence_of
from halfway.contract import EffectClass, Outcome
from halfway.core.args import parse_args
from halfway.core.classify import TimedOut, ToolRefused, Unexpected, classify
from halfway.core.next_action import StepPolicy
from halfway.tools.spec import CallContext, Found, LookupFailed, NotFound, Succeeded, ToolSpec


def ctx(timeout_s: float = 5.0) -> CallContext:
    return CallContext("tkt-1:1", "tkt-1:1", 1, timeout_s)


def adapter_of(body: Any, lookup: Any = None, *, sync: bool = False) -> tuple[Any, Any]:
    """The adapter of a keyed tool whose function (and lookup) runs `body(n)`, and its args."""
    app = App(name="hostile")
    if sync:
        def act(n: int) -> object:
            """Do it."""
            return body(n)
    else:
        async def act(n: int) -> object:
            """Do it."""
            return body(n)
    tool = app.tool(effect="keyed", key_ttl_s=3600, timeout_s=5.0)(act)
    if lookup is not None:
        @tool.lookup
        async def find(n: int) -> object:
            return lookup(n)
    registered = app.registry().get("act")
    assert registered is not None
    return registered.adapter, parse_args(registered.spec.args_model, {"n": 1})


def journals(evidence: dict[str, Any]) -> None:
    """The evidence fits the bound however it is encoded, and the journal's encoder takes it."""
    assert len(json.dumps(evidence).encode()) <= EVIDENCE_BYTES_MAX  # the widest form
    assert len(to_json(evidence)) <= EVIDENCE_BYTES_MAX  # what the journal writes


# 1. A lookup's contract: the effect (a non-empty dict) or None. Anything else proves nothing.

@pytest.mark.parametrize(("answer", "named"), [
    ({}, "an empty dict"), ([], "list"), (False, "bool"), (0, "int"), ("", "str"),
    ("secret-T-1", "str"), (["T-1"], "list"), (3.5, "float"),
])
async def test_a_lookup_that_returns_neither_the_effect_nor_none_failed(answer: object,
                                                                         named: str) -> None:
    adapter, args = adapter_of(lambda _n: {"id": "T-1"}, lambda _n: answer)
    result = await adapter.lookup(args, ctx())
    # Neither Found (done) nor NotFound (which, past completes_within_s, proves not_done).
    assert isinstance(result, LookupFailed)
    assert named in result.detail
    assert "secret" not in result.detail  # its type is named, never its content


async def test_a_lookup_still_finds_a_dict_and_nothing_for_none() -> None:
    answers: list[object] = [{"id": "T-9"}, None]
    adapter, args = adapter_of(lambda _n: {}, lambda _n: answers.pop(0))
    assert await adapter.lookup(args, ctx()) == Found(evidence={"id": "T-9"})
    assert isinstance(await adapter.lookup(args, ctx()), NotFound)


# 2. A tool that raises SystemExit, KeyboardInterrupt, GeneratorExit: unknown, like any error.

class Fatal(BaseException):
    pass


@pytest.mark.parametrize("sync", [False, True])
@pytest.mark.parametrize("exc", [SystemExit(0), SystemExit(3), KeyboardInterrupt(),
                                 GeneratorExit(), Fatal("boom")])
async def test_a_base_exception_of_a_tool_is_unknown_not_the_end_of_the_process(
        exc: BaseException, sync: bool) -> None:
    def body(_n: int) -> object:
        raise exc

    adapter, args = adapter_of(body, body, sync=sync)
    result = await adapter.call(args, ctx())
    assert isinstance(result, Unexpected)
    assert type(exc).__name__ in result.what
    assert classify(result, attempt=1).outcome is Outcome.UNKNOWN
    failed = await adapter.lookup(args, ctx())
    assert isinstance(failed, LookupFailed)
    assert type(exc).__name__ in failed.detail


async def test_cancelling_a_call_still_cancels_it() -> None:
    started, gate = asyncio.Event(), asyncio.Event()

    async def body(_n: int) -> object:
        started.set()
        await gate.wait()  # never set: only the cancel ends it
        return {}

    app = App(name="hostile")

    @app.tool(effect="keyed", key_ttl_s=3600)
    async def act(n: int) -> object:
        """Do it."""
        return await body(n)

    tool = app.registry().get("act")
    assert tool is not None
    call = asyncio.create_task(tool.adapter.call(parse_args(tool.spec.args_model, {"n": 1}),
                                                 ctx()))
    await started.wait()
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call


async def test_a_cancelled_error_raised_by_a_tool_goes_through() -> None:
    def body(_n: int) -> object:
        raise asyncio.CancelledError

    adapter, args = adapter_of(body, body)
    with pytest.raises(asyncio.CancelledError):
        await adapter.call(args, ctx())
    with pytest.raises(asyncio.CancelledError):
        await adapter.lookup(args, ctx())


@pytest.mark.parametrize("way_out", ["returns", "refuses"])
async def test_what_a_tool_says_after_swallowing_its_timeout_is_no_proof(way_out: str) -> None:
    """A tool (or lookup) that catches our timeout's cancellation and answers anyway: its
    value is not done, its refusal not "not done" (the request may be out): it timed out."""
    app = App(name="hostile")

    async def answer_when_cancelled() -> dict[str, Any]:
        try:
            await asyncio.Event().wait()  # never set: only our timeout ends it
        except BaseException:  # the cancellation, swallowed
            if way_out == "refuses":
                raise Refused("declined") from None
        return {"charge_id": "ch_made_up"}

    @app.tool(effect="keyed", key_ttl_s=3600, timeout_s=0.05)
    async def act(n: int) -> object:
        """Do it."""
        return await answer_when_cancelled()

    @act.lookup
    async def find(n: int) -> object:
        return await answer_when_cancelled()

    tool = app.registry().get("act")
    assert tool is not None
    args, short = parse_args(tool.spec.args_model, {"n": 1}), ctx(timeout_s=0.05)
    called = await tool.adapter.call(args, short)
    assert isinstance(called, TimedOut), called
    assert classify(called, attempt=1).outcome is Outcome.UNKNOWN
    looked = await tool.adapter.lookup(args, short)
    assert isinstance(looked, LookupFailed), looked
    assert "longer than 0.05 s" in looked.detail


# 3. Evidence always fits EVIDENCE_BYTES_MAX, and the journal can always write it.

def test_a_huge_key_is_not_journaled_whole() -> None:
    evidence = evidence_of({"charge_id": "ch_1", "k" * 300_000: 1})
    journals(evidence)
    assert evidence["charge_id"] == "ch_1"
    assert evidence["truncated"] is True
    assert "k" * 300_000 not in evidence


def test_many_fields_are_kept_in_order_while_they_fit() -> None:
    evidence = evidence_of({"charge_id": "ch_1", **{f"k{i}": i for i in range(100_000)}})
    journals(evidence)
    assert evidence["truncated"] is True
    kept = [k for k in evidence if k not in ("truncated", "excerpt")]
    assert kept[:3] == ["charge_id", "k0", "k1"]  # what names the effect comes first
    assert len(kept) <= FIELDS_KEPT_MAX


@pytest.mark.parametrize("blob", ["x" * 100_000, "é" * 50_000, "\U0001f600" * 50_000,
                                  '"\\' * 50_000])
def test_a_big_value_leaves_an_excerpt_that_fits(blob: str) -> None:
    evidence = evidence_of({"charge_id": "ch_1", "blob": blob})
    journals(evidence)
    assert evidence["charge_id"] == "ch_1"
    assert evidence["excerpt"].startswith('{"charge_id": "ch_1"')


class Unprintable:
    def __str__(self) -> str:
        raise RuntimeError("no words")


class Fatally:
    def __str__(self) -> str:
        raise SystemExit(1)


@pytest.mark.parametrize(("bad", "named"), [(b"\xff", "bytes"), (Unprintable(), "Unprintable"),
                                            (Fatally(), "Fatally"), (10**5000, "int")],
                         ids=["bytes", "str-raises", "str-exits", "int-too-long-to-print"])
def test_one_field_that_is_not_json_costs_only_itself(bad: object, named: str) -> None:
    evidence = evidence_of({"charge_id": "ch_1", "raw": bad, "amount": 4900})
    journals(evidence)
    assert evidence == {"charge_id": "ch_1", "raw": f"<not JSON: {named}>", "amount": 4900}


def test_lone_surrogates_are_replaced_in_strings_and_keys() -> None:
    evidence = evidence_of({"charge_id": "ch_\ud800", "\udfff": ["a\ud83d", {"\ud800": "b"}],
                            "emoji": "\ud83d\ude00", "nan": float("nan")})
    journals(evidence)
    assert evidence == {"charge_id": "ch_\ufffd", "\ufffd": ["a\ufffd", {"\ufffd": "b"}],
                        "emoji": "\U0001f600", "nan": None}


async def test_a_tools_surrogates_leave_a_done_call_done_and_a_refusal_a_refusal() -> None:
    adapter, args = adapter_of(lambda _n: {"charge_id": "ch_1", "note": "\ud800"})
    done = await adapter.call(args, ctx())
    assert done == Succeeded(evidence={"charge_id": "ch_1", "note": "\ufffd"})
    journals(done.evidence)

    def refuse(_n: int) -> object:
        raise Refused("no such card \ud800")

    adapter, args = adapter_of(refuse)
    refused = await adapter.call(args, ctx())
    assert refused == ToolRefused("no such card \ufffd")
    to_json(classify(refused).reason)  # the settlement's reason: the journal takes it


# 4. A declaration out of range fails at import, naming the tool and the argument.

def declare(**options: Any) -> Any:
    app = App(name="decl")

    async def act(n: int) -> dict:
        """Do it."""
        return {}

    return app.tool(**{"effect": "keyed", "key_ttl_s": 3600, **options})(act)


@pytest.mark.parametrize(("options", "named"), [
    ({"timeout_s": float("nan")}, "timeout_s"), ({"timeout_s": float("inf")}, "timeout_s"),
    ({"timeout_s": 1e308}, "timeout_s"), ({"timeout_s": "5"}, "timeout_s"),
    ({"timeout_s": 0}, "timeout_s"), ({"timeout_s": -1}, "timeout_s"),
    ({"timeout_s": True}, "timeout_s"),
    ({"key_ttl_s": -5}, "key_ttl_s"), ({"key_ttl_s": float("nan")}, "key_ttl_s"),
    ({"key_ttl_s": 0.001}, "key_ttl_s"), ({"key_ttl_s": True}, "key_ttl_s"),
    ({"key_ttl_s": 1e308}, "key_ttl_s"), ({"key_ttl_s": "3600"}, "key_ttl_s"),
    ({"completes_within_s": -10}, "completes_within_s"),
    ({"completes_within_s": 0}, "completes_within_s"),
    ({"completes_within_s": float("nan")}, "completes_within_s"),
    ({"completes_within_s": float("inf")}, "completes_within_s"),
    ({"key_ttl_margin_s": 7200}, "key_ttl_margin_s"),
    ({"key_ttl_margin_s": 3600}, "key_ttl_margin_s"),
    ({"key_ttl_margin_s": -1}, "key_ttl_margin_s"),
    ({"key_ttl_margin_s": float("nan")}, "key_ttl_margin_s"),
    ({"effect": "idempotent", "key_ttl_s": None, "key_ttl_margin_s": 5}, "key_ttl_margin_s"),
    ({"attempts": 1.5}, "attempts"), ({"attempts": 0}, "attempts"),
    ({"attempts": True}, "attempts"), ({"attempts": 10**6}, "attempts"),
    ({"read_attempts": 0}, "read_attempts"), ({"read_attempts": "3"}, "read_attempts"),
    ({"evidence_id": ""}, "evidence_id"), ({"evidence_id": "  "}, "evidence_id"),
    ({"evidence_id": 42}, "evidence_id"), ({"evidence_id": "x" * 256}, "evidence_id"),
    ({"once_per_subject": "no"}, "once_per_subject"),
    ({"subject": 42}, "subject"), ({"subject": "ticket:{}"}, "subject"),
    ({"subject": "ticket:{n"}, "subject"),
    ({"description": 42}, "description"),
])
def test_a_declaration_out_of_range_fails_at_import(options: dict[str, Any],
                                                     named: str) -> None:
    with pytest.raises((ValueError, TypeError), match=rf"tool act: {named}"):
        declare(**options)


def test_the_bounds_themselves_are_accepted() -> None:
    spec = declare(timeout_s=86_400, key_ttl_s=1, key_ttl_margin_s=0, completes_within_s=0.001,
                   attempts=1_000, read_attempts=1, evidence_id="charge_id").spec()
    assert isinstance(spec.timeout_s, float)  # an int given is a float, as before
    assert (spec.timeout_s, spec.key_ttl_s, spec.attempts_max) == (86_400.0, 1, 1_000)
    assert declare(key_ttl_s=366 * 86_400, key_ttl_margin_s=60).spec().key_ttl_margin_s == 60


def test_an_app_refuses_a_name_or_instructions_that_are_not_text() -> None:
    with pytest.raises(ValueError, match="app name"):
        App(name=42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="instructions"):
        App(name="decl", instructions=["be nice"])  # type: ignore[arg-type]


def test_a_tool_spec_made_by_hand_is_checked_too() -> None:
    with pytest.raises(ValueError, match="tool pay: completes_within_s"):
        ToolSpec(name="pay", description="Pay.", args_model=BaseModel,
                 effect_class=EffectClass.KEYED, timeout_s=5.0, key_ttl_s=3600,
                 completes_within_s=-10)


@pytest.mark.parametrize(("options", "named"), [
    ({"attempts_max": 0}, "attempts_max"), ({"read_attempts_max": 0}, "read_attempts_max"),
    ({"attempts_max": float("nan")}, "attempts_max"), ({"key_ttl_s": None}, "key_ttl_s"),
    ({"check_delays_s": ()}, "delay"),
])
def test_a_policy_says_what_is_wrong_with_it(options: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        StepPolicy(**{"effect_class": EffectClass.KEYED, "timeout_s": 5, "key_ttl_s": 3600,
                      **options})

