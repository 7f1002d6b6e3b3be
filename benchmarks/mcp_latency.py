"""Tool-call latency through the MCP bridge (its session reused), against a direct `mcp` call.

    .venv/bin/python benchmarks/mcp_latency.py [--calls 200] [--warmup 30] [--fresh 3]

The server is the tests' payments server (`tests/mcp_servers/payments.py`), over stdio and over
streamable HTTP, its ledger a SQLite file in a temporary folder. The call is `find_payment` by
key (a read). For each transport, interleaved call by call so that both see the same machine:

- direct: the SDK's `Client`, one session, `call_tool` with the same `_meta`;
- bridge: `McpToolAdapter.call` of the app's tool (`App.mcp` + `prepare`), which adds the key
  and step id, the session check and the classification of the answer;
- fresh session (stdio only, `--fresh` calls): a new server process and session per call,
  what the bridge avoids by keeping its session.

Prints p50 and p99 in milliseconds. Figures only; nothing here passes or fails on time.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SERVER = REPO / "tests" / "mcp_servers" / "payments.py"
START_TIMEOUT_S = 30.0
CALL_TIMEOUT_S = 10.0

from mcp import Client  # noqa: E402
from mcp.client.stdio import StdioServerParameters  # noqa: E402

from halfway import App, log  # noqa: E402
from halfway.core.args import parse_args  # noqa: E402
from halfway.mcp import KEY_META, STEP_META  # noqa: E402
from halfway.tools.spec import CallContext, Succeeded  # noqa: E402


def percentile(samples_ms: list[float], q: float) -> float:
    ordered = sorted(samples_ms)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def row(name: str, samples_ms: list[float]) -> str:
    return (f"  {name:<22} n={len(samples_ms):<5} p50 {percentile(samples_ms, 0.50):7.3f} ms"
            f"   p99 {percentile(samples_ms, 0.99):7.3f} ms"
            f"   mean {statistics.fmean(samples_ms):7.3f} ms")


async def measure(target: dict[str, Any], direct_target: Any, calls: int, warmup: int
                  ) -> tuple[list[float], list[float]]:
    app = App(name="bench")
    app.mcp("payments", **target)
    await app.prepare(wait_s=START_TIMEOUT_S)
    registry = app.registry()
    tool = registry.get("find_payment")
    assert tool is not None
    args = parse_args(tool.spec.args_model, {})
    direct_ms: list[float] = []
    bridge_ms: list[float] = []
    try:
        async with Client(direct_target) as client:
            await client.list_tools()
            for i in range(warmup + calls):
                key = f"bench-{i}:1:key"
                ctx = CallContext(f"bench-{i}:1", key, 1, CALL_TIMEOUT_S)

                async def direct(key: str = key, ctx: CallContext = ctx) -> None:
                    await client.call_tool("find_payment", {"idempotencyKey": key},
                                           read_timeout_seconds=CALL_TIMEOUT_S,
                                           meta={KEY_META: key, STEP_META: ctx.step_id})

                async def bridged(ctx: CallContext = ctx) -> None:
                    result = await tool.adapter.call(args, ctx)
                    assert isinstance(result, Succeeded), result

                # Each goes first every other time: neither pays for the other's wake-ups.
                pair = [(direct, direct_ms), (bridged, bridge_ms)]
                for call, samples_ms in pair if i % 2 else reversed(pair):
                    start = time.perf_counter()
                    await call()
                    if i >= warmup:
                        samples_ms.append((time.perf_counter() - start) * 1000)
    finally:
        await registry.aclose()
    return direct_ms, bridge_ms


async def fresh_sessions(params: StdioServerParameters, calls: int) -> list[float]:
    samples_ms = []
    for i in range(calls):
        start = time.perf_counter()
        async with Client(params) as client:
            await client.call_tool("find_payment", {"idempotencyKey": f"fresh-{i}"},
                                   read_timeout_seconds=CALL_TIMEOUT_S)
        samples_ms.append((time.perf_counter() - start) * 1000)
    return samples_ms


def http_server(db: Path) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, str(SERVER), "--db", str(db), "--http"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()  # printed once it accepts connections
    if not line.startswith("listening on "):
        proc.kill()
        raise SystemExit(f"the HTTP server did not start: {line!r}")
    return proc, line.removeprefix("listening on ")


async def main(calls: int, warmup: int, fresh: int) -> None:
    with tempfile.TemporaryDirectory() as folder:
        db = Path(folder) / "ledger.sqlite"
        command = [sys.executable, str(SERVER), "--db", str(db)]
        params = StdioServerParameters(command=command[0], args=command[1:])
        print(f"MCP tool call latency, find_payment, {calls} calls each after {warmup} "
              f"warm-up calls")
        direct, bridged = await measure({"command": command}, params, calls, warmup)
        print("stdio")
        print(row("direct mcp Client", direct))
        print(row("halfway bridge", bridged))
        if fresh:
            print(row("fresh session per call", await fresh_sessions(params, fresh)))
        proc, url = http_server(db)
        try:
            direct, bridged = await measure({"url": url}, url, calls, warmup)
        finally:
            proc.terminate()
            proc.wait(timeout=10)
        print(f"streamable HTTP ({url})")
        print(row("direct mcp Client", direct))
        print(row("halfway bridge", bridged))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--fresh", type=int, default=3,
                        help="calls with a new stdio session each (0: skip)")
    options = parser.parse_args()
    log.configure(level="WARNING")  # the sessions' own log lines would drown the figures
    asyncio.run(main(options.calls, options.warmup, options.fresh))
