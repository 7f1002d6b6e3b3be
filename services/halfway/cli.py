"""`halfway`: the command line for operators and for the README's commands.

Thin: each command parses its options, calls one function, prints the result. `--json` prints
one JSON object for scripts; otherwise lines for people.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any

import typer

from halfway import eventloop, log
from halfway.serve import Service
from halfway.settings import KafkaSettings, SettingsError

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="halfway: a journaled effects harness for AI agents, on Kafka.")


class Component(StrEnum):
    ALL = "all"
    KAFKA = "kafka"
    POSTGRES = "postgres"


def _infra(action: str, component: Component) -> None:
    from halfway.infra.__main__ import main as infra_main

    code = infra_main([action, component.value])
    if code:
        raise typer.Exit(code)


@app.command()
def up(component: Annotated[Component, typer.Argument()] = Component.ALL) -> None:
    """Start the local Kafka broker and PostgreSQL (a no-op when they run)."""
    _infra("up", component)


@app.command()
def down(component: Annotated[Component, typer.Argument()] = Component.ALL) -> None:
    """Stop the local Kafka broker and PostgreSQL."""
    _infra("down", component)


@app.command()
def topics() -> None:
    """Create halfway's topics with their configs (existing ones are left as they are)."""
    from halfway.journal import ensure_topics

    created = asyncio.run(ensure_topics(KafkaSettings.from_env()))
    typer.echo(f"created {len(created)} topics" + (f": {', '.join(created)}" if created else ""))


class Demo(StrEnum):
    RENEWAL = "renewal"
    TRIP = "trip"
    JOURNAL = "journal"


@app.command()
def demo(name: Annotated[Demo, typer.Argument()] = Demo.RENEWAL,
         as_json: Annotated[bool, typer.Option("--json", help="one JSON object")] = False,
         email: Annotated[str, typer.Option(
             help="trip: send the itinerary by http (the travel simulator) or smtp (an SMTP "
                  "relay simulator, through aiosmtplib)")] = "http",
         stripe: Annotated[bool, typer.Option(
             "--stripe", help="renewal: charge through the official stripe client (paysim "
                              "speaks Stripe's PaymentIntents)")] = False,
         ) -> None:
    """Run a demo against the real broker: the renewal (default), the trip saga, or the
    journal tour."""
    log.configure(level="WARNING")
    settings = KafkaSettings.from_env()
    if name is Demo.TRIP:
        from halfway.demo import trip

        if email not in ("http", "smtp"):
            typer.echo("halfway: --email is http or smtp", err=True)
            raise typer.Exit(2)
        result = asyncio.run(trip.run(settings, email=email))  # type: ignore[arg-type]
        typer.echo(json.dumps(trip.as_json(result), default=str) if as_json
                   else trip.as_text(result))
        ok = trip.verdict_ok(result)
    elif name is Demo.JOURNAL:
        from halfway.demo import journal_tour

        result = asyncio.run(journal_tour.run(settings))
        typer.echo(json.dumps(result.as_json(), default=str) if as_json
                   else "\n".join(result.lines))
        ok = result.replay_equal
    else:
        from halfway.demo import renewal

        ours, naive = asyncio.run(renewal.run(settings, stripe=stripe))
        typer.echo(json.dumps(renewal.as_json(ours, naive), default=str) if as_json
                   else renewal.as_text(ours, naive))
        ok = renewal.verdict_ok(ours)
    if not ok:
        raise typer.Exit(1)


class Runnable(StrEnum):
    DECIDER = "decider"
    EXECUTOR = "executor"
    RECONCILER = "reconciler"
    OUTCOMES = "outcomes"
    PROJECTOR = "projector"
    GATEWAY = "gateway"
    API = "api"
    WORKER = "worker"


AppOption = Annotated[str | None, typer.Option(
    "--app", envvar="HALFWAY_APP", show_envvar=True,
    help="the app to serve, MODULE:ATTR (imported from the current directory first); "
         "default: the built-in tools, halfway.builtin:app")]
ModelOption = Annotated[str | None, typer.Option(
    "--model", envvar="HALFWAY_MODEL", show_envvar=True,
    help="scripted (default), or openai:MODEL_NAME for any OpenAI-compatible endpoint "
         "(OPENAI_BASE_URL, OPENAI_API_KEY)")]


def _load_app(ref: str | None) -> Any:
    from halfway.app import AppNotFound, load_app

    try:
        return load_app(ref)
    except (AppNotFound, ValueError, TypeError) as exc:
        typer.echo(f"halfway: {exc}", err=True)
        raise typer.Exit(2) from None


def _load_model(ref: str | None, app_: Any) -> Any:
    from halfway.app import load_model

    try:
        return load_model(ref, app_)
    except ValueError as exc:
        typer.echo(f"halfway: {exc}", err=True)
        raise typer.Exit(2) from None


START_MCP_WAIT_S = 30.0  # how long `halfway start` waits for an app's MCP servers


def _prepare(app_: Any) -> None:
    """List the tools of the app's MCP servers (a no-op without any), then close them."""
    from halfway.mcp import McpUnavailable

    log.configure(level="WARNING")  # the sessions' info lines are not for this command

    async def listed() -> None:
        try:
            await app_.prepare(wait_s=START_MCP_WAIT_S)
        finally:
            await app_.close_mcp()

    try:
        asyncio.run(listed())
    except (McpUnavailable, ValueError) as exc:
        typer.echo(f"halfway: {exc}", err=True)
        raise typer.Exit(2) from None


@app.command()
def run(service: Annotated[Runnable, typer.Argument(help="which service")],
        app_ref: AppOption = None, model: ModelOption = None,
        metrics_port: Annotated[int | None, typer.Option(
            "--metrics-port", envvar="HALFWAY_METRICS_PORT", show_envvar=True, min=0, max=65535,
            help="serve Prometheus metrics at /metrics on this port (0: a free one)")] = None,
        ) -> None:
    """Run a service until SIGTERM: decider, executor, reconciler, outcomes (the user-facing
    topic), projector (the PostgreSQL read model), gateway (webhooks in), api (HTTP + web page),
    worker (a decider and an executor in one process: a step skips two fetch round trips)."""
    log.configure()
    from halfway.settings import KafkaSecurityError, kafka_bootstrap, kafka_security

    kinds = ("decider", "executor") if service is Runnable.WORKER else (service.value,)
    kafka_bootstrap()  # a bad one stops it here (SettingsError), before anything starts
    if service is Runnable.PROJECTOR:
        _pg_schema()  # so does a schema name it cannot write
    try:  # each service connects as its own kind (docs/security.md): a bad setting stops it here
        for kind in kinds:
            kafka_security(kind)
    except KafkaSecurityError as exc:
        typer.echo(f"halfway: {exc}", err=True)
        raise typer.Exit(2) from None
    if metrics_port is not None:
        from halfway import metrics

        metrics.serve_from_env(metrics_port)
    from halfway import collector
    from halfway.journal.admin import AUTHORIZATION_ERRORS, TopicLayoutError, access_refused

    collector.tune()
    try:
        _run_service(service, app_ref, model)
    except TopicLayoutError as exc:  # an operator's decision: waiting would not mend it
        typer.echo(f"halfway: {exc}", err=True)
        raise typer.Exit(2) from None
    except AUTHORIZATION_ERRORS as exc:  # a right missing that the check at start did not ask
        refused = access_refused(KafkaSettings.from_env(kinds[0]), service.value, exc)
        typer.echo(f"halfway: {refused}", err=True)
        raise typer.Exit(2) from None


async def _project() -> None:
    """The projector, once PostgreSQL answers: started before it, it waits (logged), as
    every service waits for the broker; one that refuses it stops it (exit 2)."""
    from halfway import settings
    from halfway.projector import store
    from halfway.projector.service import serve as serve_projector

    await store.wait_until_up(settings.pg_dsn(), log.get("halfway.projector"))
    await serve_projector()


def _run_service(service: Runnable, app_ref: str | None, model: str | None) -> None:
    match service:
        case Runnable.GATEWAY:
            from halfway.gateway import serve_gateway

            eventloop.run(serve_gateway())
        case Runnable.API:
            from halfway.api import serve_api

            eventloop.run(serve_api())
        case Runnable.PROJECTOR:
            from halfway.serve import until_stopped

            # Its credentials checked before it touches the read model; stopped while waiting.
            eventloop.run(until_stopped(_project, kind="projector"))
        case _:
            from halfway.serve import serve

            loaded = _load_app(app_ref)  # a wrong --app or --model fails here, with why
            chosen = (_load_model(model, loaded)
                      if service in (Runnable.DECIDER, Runnable.WORKER) else None)
            eventloop.run(serve(Service(service.value), app=loaded, model=chosen))


@app.command()
def dev(app_ref: AppOption = None, model: ModelOption = None) -> None:
    """The local development loop: start the broker and PostgreSQL if needed, then run every
    service of the app in this process (decider, executor, reconciler, outcomes, projector)
    with readable logs, until Ctrl-C."""
    from halfway.devloop import run_dev

    loaded = _load_app(app_ref)
    chosen = _load_model(model, loaded)
    _infra("up", Component.ALL)
    log.configure(json=False)
    from halfway import collector
    from halfway.serve import until_stopped

    collector.tune()
    eventloop.run(until_stopped(lambda: run_dev(loaded, chosen)))  # a stop while it waits too


@app.command()
def start(
    task: Annotated[str, typer.Argument(help="the task id, e.g. tkt-1 (named by you)")],
    app_ref: AppOption = None,
    input_json: Annotated[str, typer.Option(
        "--input", help='the task\'s input, a JSON object; its "prompt" is the user message')
    ] = "{}",
    tools: Annotated[str | None, typer.Option(
        help="the tools the task may use, comma-separated; default: all of the app's")] = None,
    saga: Annotated[bool, typer.Option(help="run the steps as a saga (undo on failure)")
                    ] = False,
    follow: Annotated[bool, typer.Option(
        help="print the outcomes as they come; exit 0 only if the task succeeded")] = False,
    timeout: Annotated[float | None, typer.Option(
        help="with --follow: stop following after this many seconds (exit 3)")] = None,
) -> None:
    """Start a task (task.requested on the tasks topic)."""
    import re

    from halfway.contract.ids import TASK_ID_PATTERN
    from halfway.render import one_line
    from halfway.start import BadInput, BrokerUnreachable, task_input
    from halfway.start import start as start_task

    if re.fullmatch(TASK_ID_PATTERN, task) is None:
        typer.echo(f"halfway: task id {task!r} must match {TASK_ID_PATTERN}", err=True)
        raise typer.Exit(2)
    if timeout is not None and not (follow and 0 < timeout < math.inf):  # nan is neither
        typer.echo("halfway: --timeout is how long --follow follows: a positive number of "
                   "seconds, with --follow", err=True)
        raise typer.Exit(2)
    try:
        given = task_input(task, input_json)
    except BadInput as exc:
        typer.echo(f"halfway: {exc}", err=True)
        raise typer.Exit(2) from None
    loaded = _load_app(app_ref)
    _prepare(loaded)  # an app that bridges MCP servers learns its tools from them
    allowed = ([t.strip() for t in tools.split(",") if t.strip()] if tools is not None
               else loaded.tool_names)
    unknown = sorted(set(allowed) - set(loaded.tool_names))
    if unknown or not allowed:
        typer.echo(f"halfway: app {loaded.name} has no tool {', '.join(unknown) or '(none given)'}"
                   f"; its tools: {', '.join(loaded.tool_names)}", err=True)
        raise typer.Exit(2)
    log.configure(level="WARNING")

    def echo(message: Any) -> None:
        who = "task" if message.subject == "task" else (
            f"step {message.step_id}" + (" undo" if message.subject == "compensation" else ""))
        _show(f"{who}: {one_line(message.words)}")

    try:
        code = asyncio.run(start_task(task, given, allowed, saga=saga, follow=follow,
                                      timeout_s=timeout, echo=echo))
    except BrokerUnreachable as exc:
        typer.echo(f"halfway: {exc}", err=True)
        raise typer.Exit(2) from None
    if not follow:
        typer.echo(f"{task}: requested (follow it with halfway status {task}, or start with "
                   f"--follow)")
    raise typer.Exit(code)


PortOption = Annotated[int, typer.Option(help="0 picks a free port", min=0, max=65535)]


@app.command()
def modelsim(port: PortOption = 18083,
             host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
             ) -> None:
    """Run the OpenAI-compatible model simulator (chat completions with tool calls) until
    stopped."""
    from halfway.simulators import modelsim as sim

    raise typer.Exit(sim.main(["--host", host, "--port", str(port)]))


@app.command()
def sim(port: PortOption = 18080,
        host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
        key_ttl_s: Annotated[float, typer.Option(help="how long keys are remembered")] = 86400.0,
        webhook_url: Annotated[str | None, typer.Option(
            help="where to send signed webhooks, e.g. http://127.0.0.1:18090/webhooks/paysim",
        )] = None,
        ) -> None:
    """Run the payment provider simulator (Stripe-like) until stopped."""
    from halfway import settings
    from halfway.simulators import payments

    args = ["--host", host, "--port", str(port), "--key-ttl-s", str(key_ttl_s)]
    if webhook_url:
        args += ["--webhook-url", webhook_url,
                 "--webhook-secret", settings.paysim_webhook_secret()]
    raise typer.Exit(payments.main(args))


@app.command()
def tripsim(port: PortOption = 18081,
            host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
            key_ttl_s: Annotated[float, typer.Option(help="how long keys are remembered")
                                 ] = 86400.0) -> None:
    """Run the flight, hotel and email provider simulator until stopped."""
    from halfway.simulators import travel

    raise typer.Exit(travel.main(["--host", host, "--port", str(port),
                                  "--key-ttl-s", str(key_ttl_s)]))


@app.command()
def abort(task: Annotated[str, typer.Argument(help="the task id")],
          reason: Annotated[str, typer.Option(help="why, in words the journal keeps")],
          by: Annotated[str | None, typer.Option(
              help="who calls it off; the OS user is journaled with it (alone without it)")
          ] = None) -> None:
    """Call a task off: no new step is decided, steps in flight settle, and a saga undoes
    what is proven done (last first)."""
    from halfway.resolve import ResolveRefused, abort_task, operator_identity

    log.configure(level="WARNING")
    try:
        who = operator_identity(by)
        event = asyncio.run(abort_task(KafkaSettings.from_env("operator"), task, reason=reason,
                                       by=who))
    except ResolveRefused as exc:
        typer.echo(f"refused: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"{task}: called off by {event.by}: {event.reason}")


class Verdict(StrEnum):
    DONE = "done"
    NOT_DONE = "not_done"


@app.command()
def resolve(
    step: Annotated[str, typer.Argument(
        help="the step id, e.g. renewal-8812:1; or its undo's key, e.g. trip-7:1:undo "
             "(:undo2, :undo3 once intended again)")],
    outcome: Annotated[Verdict, typer.Argument(help="done or not_done")],
    evidence: Annotated[list[str] | None, typer.Option(
        help="key=value, repeatable; done needs at least one")] = None,
    reason: Annotated[str | None, typer.Option(help="why; not_done needs one")] = None,
    by: Annotated[str | None, typer.Option(
        help="who resolves it; the OS user is journaled with it (alone without it)")] = None,
    force: Annotated[bool, typer.Option(
        help="settle a step already settled (kept as a contradiction if it disagrees)")] = False,
) -> None:
    """Settle a step, or a saga's undo, by hand (source: operator), for those that need
    attention. The first verdict in the journal counts: one that lost a race to another is
    refused, naming the first (exit 2)."""
    from halfway.contract import Outcome
    from halfway.resolve import ResolveRefused, operator_identity
    from halfway.resolve import resolve as resolve_step

    pairs = [e.split("=", 1) for e in evidence or []]
    if any(len(p) != 2 for p in pairs):
        typer.echo("evidence must be key=value", err=True)
        raise typer.Exit(2)
    log.configure(level="WARNING")
    try:
        who = operator_identity(by)
        event = asyncio.run(resolve_step(
            KafkaSettings.from_env("operator"), step, Outcome(outcome.value),
            evidence=dict(pairs) or None, reason=reason, by=who, force=force))
    except ResolveRefused as exc:
        typer.echo(f"refused: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"{step}: {event.outcome} (source operator, by {who})")


def _show(text: str) -> None:
    """Print what holds text from outside (the journal, the read model): through the one rule,
    `render.printable`, so that no control character reaches the terminal."""
    from halfway.render import printable

    typer.echo(printable(text))


def _pg_schema(*, rebuilding: bool = False) -> str:
    """HALFWAY_PG_SCHEMA, if it can name the read model (and, `rebuilding`, the schemas beside
    it that a rebuild writes); else SettingsError, which names it (exit 2)."""
    from halfway import settings
    from halfway.projector import store

    schema = settings.pg_schema()
    try:
        if rebuilding:
            from halfway.projector.rebuild import schemas_of

            schemas_of(schema)
        return store.checked(schema)
    except ValueError as exc:
        raise SettingsError(f"HALFWAY_PG_SCHEMA={schema[:80]!r} cannot be used: {exc}") from None


async def _read_model(fn: Any) -> Any:
    import asyncpg

    from halfway import settings
    from halfway.projector import store

    schema = _pg_schema()  # before connecting: a database that is down is not the news
    conn = await store.connect(settings.pg_dsn())  # store.Unreachable: one line (main)
    try:
        return await fn(conn, schema)
    except (asyncpg.UndefinedTableError, asyncpg.InvalidSchemaNameError):
        typer.echo("the read model does not exist yet: is the projector running "
                   "(halfway run projector), or rebuild it (halfway replay --rebuild)?", err=True)
        raise typer.Exit(1) from None
    finally:
        await conn.close()


@app.command()
def tasks(state: Annotated[str | None, typer.Option(help="only tasks in this state")] = None,
          limit: Annotated[int, typer.Option(help="at most this many")] = 50,
          as_json: Annotated[bool, typer.Option("--json", help="one JSON object")] = False,
          ) -> None:
    """List tasks from the read model, newest first, with their three-state standing."""
    from halfway.api import queries
    from halfway.api import status as tables

    try:
        rows = asyncio.run(_read_model(lambda c, s: queries.list_tasks(c, s, state, limit)))
    except ValueError as exc:  # its words name what it takes (an unknown state: the states)
        typer.echo(f"halfway: {exc}", err=True)
        raise typer.Exit(2) from None
    _show(tables.as_json(tables.tasks_json(rows)) if as_json
          else tables.tasks_table(rows, now=datetime.now(UTC)))


@app.command()
def status(task: Annotated[str | None, typer.Argument(
               help="the task id; without one: the local broker and PostgreSQL")] = None,
           as_json: Annotated[bool, typer.Option("--json", help="one JSON object")] = False,
           ) -> None:
    """Every step of a task: done with evidence, not done with the reason, or unknown with the
    reference and the next check; attempts; undo. Without a task: the local infrastructure."""
    if task is None:
        _infra("status", Component.ALL)
        return
    from halfway.api import queries
    from halfway.api import status as tables

    found = asyncio.run(_read_model(lambda c, s: queries.get_task(c, s, task)))
    if found is None:
        typer.echo(f"no task {task} in the read model", err=True)
        raise typer.Exit(1)
    _show(tables.as_json(tables.task_json(found)) if as_json
          else tables.status_table(found, now=datetime.now(UTC)))


@app.command()
def replay(task: Annotated[str | None, typer.Option(help="only this task")] = None,
           as_json: Annotated[bool, typer.Option("--json", help="one JSON object")] = False,
           rebuild: Annotated[bool, typer.Option(
               "--rebuild", help="drop the read model and rebuild it from the journal")] = False,
           check: Annotated[bool, typer.Option(
               "--check", help="with --rebuild: compare with the live copy, do not swap; "
                               "exit 1 if they differ or there is no live copy")
           ] = False,
           ) -> None:
    """Rebuild every task's state from the journal alone and print it; or, with --rebuild,
    rebuild the PostgreSQL read model (compared row for row with the live one)."""
    if check and not rebuild:
        typer.echo("halfway: --check compares a rebuilt read model with the live one: give it "
                   "with --rebuild", err=True)
        raise typer.Exit(2)
    if rebuild and (task is not None or as_json):
        typer.echo("halfway: --rebuild rebuilds every task's rows and prints a report; --task "
                   "and --json are for the replay without it", err=True)
        raise typer.Exit(2)
    if rebuild:
        _rebuild_read_model(check_only=check)
        return
    from halfway.journal import replay as replay_journal
    from halfway.render import one_line, step_line, task_summary

    log.configure()
    result = asyncio.run(replay_journal(KafkaSettings.from_env("operator")))
    states = [s for t, s in sorted(result.states.items()) if task in (None, t)]
    if task is not None and not states:  # as `halfway status` says of the read model
        typer.echo(f"no task {task} in the journal", err=True)
        raise typer.Exit(1)
    if as_json:
        typer.echo(json.dumps({"events": result.events, "invalid": len(result.invalid),
                               "tasks": [task_summary(s) for s in states]}, default=str))
        return
    for state in states:
        attention = " (needs attention)" if state.needs_attention else ""
        _show(f"{state.task_id}: {state.final_state or state.status}{attention}")
        for step in state.steps.values():
            _show(f"  {step.step_id}  {one_line(step_line(step))}")
    typer.echo(f"{result.events} events, {len(result.invalid)} invalid, {len(states)} tasks",
               err=not sys.stdout.isatty())


def _rebuild_read_model(*, check_only: bool) -> None:
    from rich.progress import Progress

    from halfway import settings
    from halfway.projector.rebuild import rebuild

    schema = _pg_schema(rebuilding=True)  # a bad one: one line (exit 2), before anything runs
    log.configure(level="WARNING")
    with Progress(transient=True) as bar:
        job = bar.add_task("replaying the journal", total=None)

        def progress(done: int, total: int) -> None:
            bar.update(job, completed=done, total=total)

        report = asyncio.run(rebuild(KafkaSettings.from_env("operator"), settings.pg_dsn(),
                                     progress=progress, check_only=check_only,
                                     live=schema))
    _show("\n".join(report.lines()))
    # A check's answer is its exit code (no live copy equals nothing); a swap succeeded
    # whatever the old copy held (a live projector's lag, or what the rebuild came to mend).
    if check_only and not report.matches_live:
        raise typer.Exit(1)


mcp_app = typer.Typer(no_args_is_help=True, help="MCP: halfway in front of agents whose loop "
                                                 "we don't own.")
app.add_typer(mcp_app, name="mcp")


class McpTransport(StrEnum):
    STDIO = "stdio"
    HTTP = "http"


@mcp_app.command("serve")
def mcp_serve(
    app_ref: AppOption = None, model: ModelOption = None,
    transport: Annotated[McpTransport, typer.Option(help="stdio, or streamable HTTP")] =
    McpTransport.STDIO,
    host: Annotated[str, typer.Option(help="http: the address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="http: the port (0 picks a free one)", min=0,
                                      max=65535)] = 18110,
    task: Annotated[str | None, typer.Option(
        help="stdio: the session's task id (default: a new one per connection)")] = None,
    wait_s: Annotated[float, typer.Option(
        "--wait-s", help="how long a call waits for its step to settle before it is "
                         "answered unknown")] = 25.0,
    idle_s: Annotated[float, typer.Option(
        "--idle-s", help="a session without a call this long is ended")] = 1800.0,
) -> None:
    """Serve the app's tools as an MCP server: each session is a task, each tools/call a
    journaled step with a harness-minted key, answered done, not done or unknown."""
    from halfway.mcp.proxy import serve_proxy

    if not (0 < wait_s < math.inf and 0 < idle_s < math.inf):  # nan is neither
        typer.echo("halfway: --wait-s and --idle-s must be positive numbers of seconds",
                   err=True)
        raise typer.Exit(2)
    loaded = _load_app(app_ref)
    chosen = _load_model(model, loaded)  # for tasks that are not MCP sessions
    log.configure()  # to stderr: over stdio, stdout is the MCP connection
    from halfway import collector
    from halfway.serve import until_stopped

    collector.tune()
    eventloop.run(until_stopped(lambda: serve_proxy(  # a stop while it waits for the broker too
        loaded, chosen, transport=transport.value, host=host, port=port, call_wait_s=wait_s,
        session_idle_s=idle_s, task=task)))


def main() -> None:
    """The `halfway` command: a setting it cannot use, read at any point of any command, is a
    one-line error naming the variable (exit 2), not a traceback; so is a broker or a database
    that does not answer (exit 1; one that refuses us: exit 2)."""
    from aiokafka.errors import KafkaConnectionError

    from halfway.projector.store import Unreachable

    try:
        app()
    except SettingsError as exc:
        typer.echo(f"halfway: {exc}", err=True)
        sys.exit(2)
    except KafkaConnectionError as exc:
        refused = _login_refused()
        if refused is not None:  # aiokafka says "Unable to bootstrap" for a wrong password too
            typer.echo(f"halfway: {refused}", err=True)
            sys.exit(2)
        typer.echo(f"halfway: no Kafka broker answers at {_kafka_address()} ({exc}): is it "
                   "running (halfway up, or halfway dev)? HALFWAY_KAFKA_BOOTSTRAP or "
                   "HALFWAY_KAFKA_PORT say where", err=True)
        sys.exit(1)
    except Unreachable as exc:  # the read model's database; the message says where and why
        typer.echo(f"halfway: {exc}", err=True)
        sys.exit(1 if exc.passing else 2)


LOGIN_CHECK_S = 15.0  # asking a broker whether it refused our credentials, at most


def _login_refused() -> str | None:
    """Why the broker refuses the operator's credentials, if it does (the commands that meet
    a bare connection error act as the operator; every kind's credentials come from the same
    place)."""
    from halfway.journal.admin import KafkaAccessError, check_login

    async def check() -> None:
        async with asyncio.timeout(LOGIN_CHECK_S):
            await check_login(KafkaSettings.from_env("operator"))

    try:
        asyncio.run(check())
    except KafkaAccessError as exc:
        return str(exc)
    except Exception:  # nobody answers, or the check itself failed: the broker is the news
        return None
    return None


def _kafka_address() -> str:
    try:
        return KafkaSettings.from_env().bootstrap
    except SettingsError:
        return "(the configured address)"


if __name__ == "__main__":
    main()
