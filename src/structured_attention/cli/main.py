"""The ``sattn`` command. Errors in what the user gave end with one line and exit status 2."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import bench, describe, sweep, train


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sattn", description="structured attention: costs, training and benchmarks")
    sub = parser.add_subparsers(dest="command", required=True)
    describe.add_parser(sub)
    bench.add_parser(sub)
    train.add_parser(sub)
    sweep.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"sattn {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
