"""The `moee` command line: one sub-command per module in `moee.commands`.

Each module in COMMANDS defines `register(subparsers)` (adds its parser and sets
`func`), so sub-commands stay next to the code they drive and import lazily.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = (
    "embed",
    "search",
    "evaluate",
    "fit_reference",
    "report",
    "train",
    "simulate",
    "quickstart",
    "upcycle",
    "serve",
    "ablate",
    "routes",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moee", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"moee.commands.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (
        ValueError,
        TypeError,
        FileNotFoundError,
        IsADirectoryError,
        NotADirectoryError,
        FileExistsError,
    ) as exc:
        print(f"moee {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
