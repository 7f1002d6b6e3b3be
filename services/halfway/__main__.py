"""The `halfway` command's entry (`python -m halfway`, and the installed `halfway` script).

The cycle collector is tuned (`halfway.collector`) before the command's modules are imported:
importing them builds about 100,000 objects that all live on, and with CPython's thresholds the
collector walked them some 140 times meanwhile, finding almost nothing (about 1,200 objects):
70-100 ms of a service's 0.7-0.9 s of imports, measured with `gc.callbacks`.
"""

from __future__ import annotations

from halfway import collector


def main() -> None:
    collector.tune()
    from halfway.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
