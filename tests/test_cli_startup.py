"""The command line starts without torch: ``moee --help`` and every sub-command's parser are built
from metadata only (torch and transformers take seconds to import and load only when a command runs)."""

from __future__ import annotations

import subprocess
import sys

from moee.cli import build_parser


def test_building_every_parser_imports_no_torch():
    code = (
        "import sys\n"
        "from moee.cli import build_parser\n"
        "parser = build_parser()\n"
        "parser.format_help()\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'mteb') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "", f"building the CLI imported {out.stdout.strip()}"


def test_router_choices_are_the_gate_registry():
    from moee.moe.gate_registry import GATES

    parser = build_parser()
    args = parser.parse_args(
        ["upcycle", "src", "--out", "dst", "--experts", "4", "--top-k", "2", "--router", "switch"]
    )
    assert args.router == "switch"
    action = next(
        a
        for sub in parser._subparsers._group_actions
        for a in sub.choices["upcycle"]._actions
        if a.dest == "router"
    )
    assert list(action.choices) == list(GATES) and "nope" not in action.choices
