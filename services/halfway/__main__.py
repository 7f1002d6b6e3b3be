"""The `halfway` command's entry (`python -m halfway`, and the installed `halfway` script).

Importing the command's modules builds about 100,000 objects that all live on. The cycle
collector is tuned (`halfway.collector`) before, so it does not walk them meanwhile (with
CPython's thresholds it did, some 140 times, for about 1,200 objects: 65-96 ms of a service's
0.66-0.87 s of imports, measured with `gc.callbacks`), and they are frozen after, so no later
collection walks them either (the first young one did: a restart's seven took 136 ms).
"""

from __future__ import annotations

import gc

from halfway import collector


def main() -> None:
    collector.tune()
    from halfway.cli import main as cli_main

    gc.freeze()
    cli_main()


if __name__ == "__main__":
    main()
