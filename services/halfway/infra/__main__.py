"""`python -m halfway.infra up|down|status [kafka|postgres|all]`

Prints one line per component (`kafka: started in 4.12 s (pid=... bootstrap=...)`). Exits 1 with
the reason (and the relevant log tail) on stderr when a component cannot be brought up or down,
2 on a usage error. `infra/dev up|down|status` calls this after setting up the Python env.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from types import ModuleType

from halfway.infra import ComponentStatus, InfraError, kafka, postgres

# PostgreSQL first on `up`: it takes about a second, so a broken install shows before the
# broker's longer start; the reverse on `down`, so nothing that writes the read model outlives
# the database for long (today nothing does; the order costs nothing).
COMPONENTS: dict[str, ModuleType] = {"postgres": postgres, "kafka": kafka}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m halfway.infra",
        description="Start, stop or inspect the local Kafka broker and PostgreSQL.",
    )
    parser.add_argument("action", choices=["up", "down", "status"])
    parser.add_argument("component", nargs="?", default="all",
                        choices=[*COMPONENTS, "all"])
    args = parser.parse_args(argv)

    names = list(COMPONENTS) if args.component == "all" else [args.component]
    if args.action == "down":
        names.reverse()
    for name in names:
        verb: Callable[[], ComponentStatus] = getattr(COMPONENTS[name], args.action)
        try:
            result = verb()
        except (InfraError, ValueError) as exc:
            print(f"{name}: FAILED to {args.action}: {exc}", file=sys.stderr, flush=True)
            return 1
        print(result.line(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
