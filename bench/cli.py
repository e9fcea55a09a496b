"""`qasr-bench`: `offline` (engine latency/throughput beside the official backend), `stream` (live server load),
`partial-reuse` (what a stream's cached windows and KV save its partials)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"offline": "qasr.bench.offline", "stream": "qasr.bench.stream",
                "partial-reuse": "qasr.bench.partial_reuse"}
    if not argv or argv[0] not in commands:
        print(f"usage: qasr-bench {{{','.join(commands)}}} [options]  (qasr-bench COMMAND --help)", file=sys.stderr)
        raise SystemExit(2)
    import importlib

    importlib.import_module(commands[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    main()
