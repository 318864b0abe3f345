"""Analyses of MoE routing: RW-vs-HS clustering overlap, prompt stability, expert specialization
reports, the router-collapse simulator and the load-balancing ablation.

Modules import their heavy dependencies lazily; this package only holds a small helper shared by
the analysis sub-commands.
"""

from __future__ import annotations

import argparse

__all__ = ["command_line"]


def command_line(args: argparse.Namespace) -> list[str]:
    """Rebuild the ``moee <command> --flag value ...`` line from parsed arguments.

    Result files record the command that made them; ``sys.argv`` is wrong when ``moee.cli.main``
    is called from Python (tests, notebooks), so the line is rebuilt from what was parsed (a list,
    from ``nargs="+"``, as the flag followed by its values, so the shell-quoted line re-runs).
    """
    parts = ["moee", str(args.command)]
    for key, value in vars(args).items():
        if key in ("command", "func") or value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            parts.append(flag)
        elif isinstance(value, (list, tuple)):  # nargs="+": the flag, then every value
            parts += [flag, *map(str, value)]
        else:
            parts += [flag, str(value)]
    return parts
