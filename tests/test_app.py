"""The app API without a broker: what `@app.tool` builds, and what a function's outcome proves.

The tool author writes plain Python; these tests pin what each way out of a function means for
the harness (done with evidence, proof of not done, never reached, unknown), and what a
declaration mistake says at import time.
"""

from __future__ import annotations

import asyncio
import sys
import textwrap
from pathlib import Path
from typing import Annotated, Literal

import aiohttp
import httpx
import multidict
import pytest
import yarl
from pydantic import Field, ValidationError

from halfway import App, Refused
from halfway.app import AppNotFound, load_app, load_model
from halfway.contract import EffectClass, Outcome, SagaRole
from halfway.core.args import parse_args
from halfway.core.classify import NotSent, TimedOut, ToolRefused, Unexpected, Unproven, classify
from halfway.models import ScriptedModel
from halfway.tools.spec import CallContext, Found, LookupFailed, NotFound, Succeeded


def ctx(attempt: int = 1, timeout_s: float = 5.0) -> CallContext:
    return CallContext("tkt-1:1", "tkt-1:1", attempt, timeout_s)


def ticket_app() -> App:
    app = App(name="tickets", instructions="You open support tickets.")

    @app.tool(effect="keyed", key_ttl_s=86_400, timeout_s=5.0, subject="ticket:{ref}",
              evidence_id="ticket_id")
    async def open_ticket(ref: Annotated[str, Field(pattern=r"^[A-Z]+-\d+$")], title: str,
                          priority: Literal["low", "high"] = "low", *, ctx: CallContext
                          ) -> dict:
        """Open a support ticket."""
        return {"ticket_id": f"T-{ref}", "key": ctx.key, "priority": priority}

    @open_ticket.lookup
    async def find_ticket(ref: str, *, ctx: CallContext) -> dict | None:
        return None

    return app


def test_the_decorator_builds_the_one_model_of_a_tool() -> None:
    app = ticket_app()
    tool = app.registry().get("open_ticket")
    assert tool is not None
    spec = tool.spec
    assert spec.effect_class is EffectClass.KEYED
    assert (spec.key_ttl_s, spec.timeout_s, spec.has_lookup) == (86_400, 5.0, True)
    assert spec.description == "Open a support ticket."  # what the model reads
    assert spec.subject(parse_args(spec.args_model, {"ref": "ACME-42", "title": "x"})) == \
        "ticket:ACME-42"
    schema = spec.args_model.model_json_schema()
    assert set(schema["properties"]) == {"ref", "title", "priority"}  # ctx is not an argument
    assert schema["required"] == ["ref", "title"]
    assert spec.effect_id({"ticket_id": "T-1"}) == "T-1"
    policy = spec.policy()
    assert policy is spec.policy()  # made once per spec: asked on every move
    assert (policy.effect_class, policy.timeout_s, policy.key_ttl_s) == \
        (EffectClass.KEYED, 5.0, 86_400)
    assert policy.lookup_window_s == 86_400
    assert policy.key_ttl_margin_s == 60.0


@pytest.mark.parametrize(("args", "why"), [
    ({"ref": "ACME-42"}, "title"),                               # missing
    ({"ref": "acme", "title": "x"}, "ref"),                      # against its pattern
    ({"ref": "ACME-42", "title": 42}, "title"),                  # strict: no coercion
    ({"ref": "ACME-42", "title": "x", "urgent": True}, "urgent"),  # unknown argument
    ({"ref": "ACME-42", "title": "x", "priority": "asap"}, "priority"),
])
def test_arguments_are_validated_strictly(args: dict, why: str) -> None:
    spec = ticket_app().registry().get("open_ticket").spec  # type: ignore[union-attr]
    with pytest.raises(ValidationError, match=why):
        parse_args(spec.args_model, args)


async def test_a_return_value_is_done_with_that_evidence() -> None:
    tool = ticket_app().registry().get("open_ticket")
    assert tool is not None
    args = parse_args(tool.spec.args_model, {"ref": "ACME-42", "title": "Printer on fire"})
    result = await tool.adapter.call(args, ctx())
    assert result == Succeeded(evidence={"ticket_id": "T-ACME-42", "key": "tkt-1:1",
                                         "priority": "low"})


def one_tool_app(body, *, effect: str = "keyed", timeout_s: float = 5.0) -> App:
    app = App(name="one")

    @app.tool(effect=effect, key_ttl_s=3600, timeout_s=timeout_s)
    async def act(n: int, *, ctx: CallContext) -> object:
        """Do it."""
        return await body(ctx)

    return app


async def outcome_of(body, attempt: int = 1, timeout_s: float = 5.0):
    tool = one_tool_app(body, timeout_s=timeout_s).registry().get("act")
    assert tool is not None
    return await tool.adapter.call(parse_args(tool.spec.args_model, {"n": 1}),
                                   ctx(attempt, timeout_s))


async def test_refused_is_proof_of_not_done() -> None:
    async def body(_ctx):
        raise Refused("the customer has no such account")

    result = await outcome_of(body)
    assert result == ToolRefused("the customer has no such account")
    assert classify(result, attempt=3).outcome is Outcome.NOT_DONE


async def test_a_connect_error_is_never_reached_on_the_first_attempt_only() -> None:
    async def body(_ctx):
        async with httpx.AsyncClient() as client:  # nothing listens on port 9 here
            await client.post("http://127.0.0.1:9/tickets", timeout=2.0)

    result = await outcome_of(body)
    assert isinstance(result, NotSent)
    assert classify(result, attempt=1).outcome is Outcome.NOT_DONE
    assert classify(await outcome_of(body, attempt=2), attempt=2).outcome is Outcome.UNKNOWN


async def test_aiohttp_failures_are_classified_like_httpx_ones() -> None:
    async def refused(_ctx):
        async with aiohttp.ClientSession() as session, \
                session.post("http://127.0.0.1:9/tickets") as response:  # nothing listens
            return await response.json()

    never = await outcome_of(refused)
    assert isinstance(never, NotSent)
    assert classify(never).outcome is Outcome.NOT_DONE

    def answer(status: int):
        async def body(_ctx):
            url = yarl.URL("http://provider/tickets")
            info = aiohttp.RequestInfo(url, "POST", multidict.CIMultiDictProxy(
                multidict.CIMultiDict()), url)
            raise aiohttp.ClientResponseError(info, (), status=status,
                                              message="no such customer")
        return body

    refusal = await outcome_of(answer(422))
    assert classify(refusal).outcome is Outcome.NOT_DONE
    assert "no such customer" in classify(refusal).reason
    assert classify(await outcome_of(answer(503))).outcome is Outcome.UNKNOWN


async def test_a_timeout_is_unknown() -> None:
    gate = asyncio.Event()

    async def body(_ctx):
        await gate.wait()  # never set: the tool's own timeout ends it

    result = await outcome_of(body, timeout_s=0.05)
    assert result == TimedOut(0.05)
    assert classify(result).outcome is Outcome.UNKNOWN


async def test_a_call_whose_code_runs_on_past_its_timeout_ends_only_with_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain function's thread runs on past the timeout (nothing stops it), and so does a
    tool that would not stop: either may still send. The call is a timeout, but only once
    that code has ended: settled sooner, a lookup could "prove" not done before the late
    request landed."""
    import contextlib
    import threading

    from halfway.app import runaway

    monkeypatch.setattr(runaway, "CANCEL_GRACE_S", 0.01)
    release, ended = threading.Event(), []
    app = App(name="slow")

    @app.tool(effect="keyed", key_ttl_s=3600, timeout_s=0.05)
    def prepare_then_send(n: int) -> dict:
        """Slow to prepare its request."""
        release.wait(5)
        ended.append("thread")
        return {"sent": n}

    @app.tool(effect="keyed", key_ttl_s=3600, timeout_s=0.05)
    async def stubborn(n: int) -> dict:
        """Would not stop."""
        while not release.is_set():
            with contextlib.suppress(BaseException):
                await asyncio.sleep(0.01)
        ended.append("task")
        return {"sent": n}

    for name, what in (("prepare_then_send", "thread"), ("stubborn", "task")):
        release.clear()
        tool = app.registry().get(name)
        assert tool is not None
        call = asyncio.ensure_future(tool.adapter.call(
            parse_args(tool.spec.args_model, {"n": 1}), ctx(timeout_s=0.05)))
        await asyncio.wait({call}, timeout=0.3)  # its timeout long past: still running
        assert not call.done(), name
        release.set()
        assert await call == TimedOut(0.05)
        assert ended[-1] == what  # returned only once its code had ended

async def test_any_other_exception_is_unknown() -> None:
    async def body(_ctx):
        raise KeyError("id")

    result = await outcome_of(body)
    assert isinstance(result, Unexpected)
    assert "KeyError" in result.what
    assert classify(result).outcome is Outcome.UNKNOWN


async def test_raise_for_status_is_the_providers_answer() -> None:
    def answer(status: int):
        async def body(_ctx):
            request = httpx.Request("POST", "http://provider/tickets")
            response = httpx.Response(status, request=request, json={
                "error": {"code": "invalid_ref", "message": "no such customer"}})
            response.raise_for_status()
        return body

    refused = await outcome_of(answer(422))
    assert classify(refused).outcome is Outcome.NOT_DONE
    assert "no such customer" in classify(refused).reason
    assert classify(await outcome_of(answer(503))).outcome is Outcome.UNKNOWN
    assert classify(await outcome_of(answer(429))).outcome is Outcome.UNKNOWN


async def test_with_a_lookup_a_tools_exception_is_no_proof_that_nothing_happened() -> None:
    """The charge went through; the receipt fetched after it could not connect, or was a 404.
    Read as the effect's own failure that would be "not done, safe to try again", and the
    model's next try a second charge: with a lookup, it is unknown, and the lookup tells."""
    charged: list[str] = []
    app = App(name="charges")

    @app.tool(effect="keyed", key_ttl_s=3600, timeout_s=5.0)
    async def charge_then_receipt(amount: int, then: str, *, ctx: CallContext) -> dict:
        """Charge, then fetch the receipt."""
        charged.append(ctx.key)
        if then == "refused":
            raise Refused("the card was declined")  # the author's word: proof
        request = httpx.Request("GET", "http://provider/receipts/1")
        if then == "404":
            httpx.Response(404, request=request).raise_for_status()
        async with httpx.AsyncClient() as client:  # nothing listens on port 9 here
            await client.get("http://127.0.0.1:9/receipts/1", timeout=2.0)
        return {}

    @charge_then_receipt.lookup
    async def find_charge(amount: int, then: str, *, ctx: CallContext) -> dict | None:
        return {"charge": ctx.key} if ctx.key in charged else None

    tool = app.registry().get("charge_then_receipt")
    assert tool is not None
    for then in ("connect", "404"):
        result = await tool.adapter.call(
            parse_args(tool.spec.args_model, {"amount": 49, "then": then}), ctx())
        assert isinstance(result, Unproven), then
        verdict = classify(result)
        assert verdict.outcome is Outcome.UNKNOWN
        assert "its lookup tells" in verdict.reason
    refused = await tool.adapter.call(
        parse_args(tool.spec.args_model, {"amount": 49, "then": "refused"}), ctx())
    assert classify(refused).outcome is Outcome.NOT_DONE

async def test_evidence_is_never_empty_and_always_json() -> None:
    async def nothing(_ctx):
        return None

    async def huge(_ctx):
        return {"ticket_id": "T-1", "blob": "x" * 100_000}

    empty = await outcome_of(nothing)
    assert isinstance(empty, Succeeded)
    assert empty.evidence == {"result": None}
    big = await outcome_of(huge)
    assert isinstance(big, Succeeded)
    assert big.evidence["ticket_id"] == "T-1"
    assert big.evidence["truncated"] is True
    assert len(str(big.evidence)) < 20_000


async def test_a_lookup_says_found_not_found_or_failed() -> None:
    app = App(name="lookups")
    answers: list[object] = []

    @app.tool(effect="keyed", key_ttl_s=60)
    async def act(n: int, *, ctx: CallContext) -> dict:
        """Do it."""
        return {}

    @act.lookup
    async def find(n: int, *, ctx: CallContext) -> dict | None:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer  # type: ignore[return-value]

    tool = app.registry().get("act")
    assert tool is not None
    args = parse_args(tool.spec.args_model, {"n": 1})
    answers[:] = [{"id": "T-9"}, None, Refused("declined"), RuntimeError("search is down")]
    assert await tool.adapter.lookup(args, ctx()) == Found(evidence={"id": "T-9"})
    assert isinstance(await tool.adapter.lookup(args, ctx()), NotFound)
    declined = await tool.adapter.lookup(args, ctx())
    assert isinstance(declined, Found)
    assert not declined.succeeded
    failed = await tool.adapter.lookup(args, ctx())
    assert isinstance(failed, LookupFailed)
    assert "search is down" in failed.detail


def test_declaration_mistakes_show_at_import() -> None:
    app = App(name="mistakes")
    with pytest.raises(TypeError, match="needs a type hint"):
        @app.tool()
        async def untyped(ref, *, ctx) -> dict:
            """x"""
            return {}
    with pytest.raises(ValueError, match="not its arguments"):
        @app.tool(subject="ticket:{reference}")
        async def wrong_subject(ref: str) -> dict:
            """x"""
            return {}
    with pytest.raises(ValueError, match="key_ttl_s"):
        @app.tool(effect="keyed")
        async def no_ttl(ref: str) -> dict:
            """x"""
            return {}
    with pytest.raises(ValueError, match="docstring"):
        @app.tool()
        async def undocumented(ref: str) -> dict:
            return {}
    with pytest.raises(ValueError, match=r"is not a valid EffectClass"):
        app.tool(effect="maybe")


def test_an_undo_makes_a_compensable_tool_and_must_exist() -> None:
    app = App(name="trips")

    @app.tool(effect="keyed", key_ttl_s=60, undo=("cancel", {"id": "$result.id"}))
    async def book(hotel: str) -> dict:
        """Book."""
        return {"id": "B-1"}

    with pytest.raises(ValueError, match="undo tools missing"):
        app.registry()

    app = App(name="trips")
    app.tool(effect="keyed", key_ttl_s=60, undo=("cancel", {"id": "$result.id"}))(book.fn)

    @app.tool(effect="idempotent")
    async def cancel(id: str) -> dict:
        """Cancel."""
        return {"cancelled": id}

    assert app.registry().get("book").spec.saga_role is SagaRole.COMPENSABLE  # type: ignore[union-attr]


def test_the_fingerprint_follows_what_the_tools_mean() -> None:
    a, b = ticket_app(), ticket_app()
    assert a.fingerprint == b.fingerprint
    assert a.label == f"tickets@{a.fingerprint}"

    @b.tool(effect="read")
    async def list_tickets(ref: str) -> dict:
        """List."""
        return {}

    assert b.fingerprint != a.fingerprint


def test_an_app_is_loaded_from_the_current_directory(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "myagent.py").write_text(textwrap.dedent('''
        from halfway import App
        app = App(name="mine", instructions="be careful")

        @app.tool(effect="read")
        async def look(q: str) -> dict:
            """Look something up."""
            return {"q": q}

        not_an_app = 42
    '''))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "myagent", raising=False)
    monkeypatch.setattr(sys, "path", list(sys.path))
    app = load_app("myagent:app")
    assert (app.name, app.tool_names) == ("mine", ["look"])
    with pytest.raises(AppNotFound, match=r"not a halfway\.App"):
        load_app("myagent:not_an_app")
    with pytest.raises(AppNotFound, match="has no nothing"):
        load_app("myagent:nothing")
    with pytest.raises(AppNotFound, match="no module"):
        load_app("nosuchmodule:app")
    with pytest.raises(AppNotFound, match="MODULE:ATTR"):
        load_app("myagent")
    monkeypatch.setenv("HALFWAY_APP", "myagent:app")
    assert load_app().name == "mine"


def test_the_builtin_app_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HALFWAY_APP", raising=False)
    app = load_app()
    assert app.name == "builtin"
    assert {"charge_customer", "hold_flight", "send_email"} <= set(app.tool_names)


def test_the_model_option_wins_over_the_apps_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HALFWAY_MODEL", raising=False)
    own = ScriptedModel()
    app = App(name="own", model=own)
    assert load_model(None, app) is own
    assert isinstance(load_model("scripted", app), ScriptedModel)
    assert load_model("scripted", app) is not own
    with pytest.raises(ValueError, match="openai:MODEL_NAME"):
        load_model("gpt-4o", app)
