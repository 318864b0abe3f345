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
    Private entries (``_name``: a repeatable flag's values so far, ``moee.cli_options``) are no flags.
    An embedding flag is present only when given (``moee.cli_options``), so one given as ``none``
    is written as such: left out, the model's own value would replace it on a re-run.
    """
    from dataclasses import fields

    from moee.embed.config import EmbeddingConfig

    embedding = {f.name for f in fields(EmbeddingConfig)}
    parts = ["moee", str(args.command)]
    for key, value in vars(args).items():
        if value is None and key in embedding:
            parts += ["--" + key.replace("_", "-"), "none"]
            continue
        if key in ("command", "func") or key.startswith("_") or value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            parts.append(flag)
        elif isinstance(value, (list, tuple)):  # nargs="+": the flag, then every value
            parts += [flag, *map(str, value)]
        else:
            parts += [flag, str(value)]
    return parts
