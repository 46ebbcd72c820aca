"""The ``tmem`` command line. Each subcommand lives in its own module and is listed in COMMANDS.

To add one (build, query, answer, serve, runs, eval): write ``tmem/cli/<name>_cmd.py`` defining
``COMMAND = Command(...)`` (see :mod:`tmem.cli.base`) and append it to :data:`COMMANDS`.

Exit codes: 0 success; 2 bad input (usage, malformed archive, missing store, invalid settings);
3 ``tmem build`` published, but some conversations were quarantined; 1 any other failure.
``tmem forget`` exits 2 when it refuses (nothing removed). Errors print ``error: <message>`` on stderr.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from pydantic import ValidationError

from tmem import __version__
from tmem.cli import (
    answer_cmd,
    build_cmd,
    eval_cmd,
    forget_cmd,
    ingest_cmd,
    mcp_cmd,
    quarantine_cmd,
    query_cmd,
    runs_cmd,
    serve_cmd,
    snapshot_cmd,
    stats_cmd,
)
from tmem.cli.base import CliContext, Command
from tmem.errors import DatasetError, ForgetError, IngestError, ScopeError, StoreError, TmemError

COMMANDS: tuple[Command, ...] = (
    ingest_cmd.COMMAND, build_cmd.COMMAND, stats_cmd.COMMAND, query_cmd.COMMAND, answer_cmd.COMMAND, serve_cmd.COMMAND,
    runs_cmd.COMMAND, quarantine_cmd.COMMAND, eval_cmd.COMMAND, mcp_cmd.COMMAND, forget_cmd.COMMAND, snapshot_cmd.COMMAND,
)

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_BAD_INPUT = 2
INPUT_ERRORS: tuple[type[TmemError], ...] = (IngestError, DatasetError, ScopeError, StoreError, ForgetError)


def build_parser(commands: Sequence[Command] = COMMANDS) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tmem", description="T-Mem: long-term memory for conversational assistants.")
    parser.add_argument("--version", action="version", version=f"tmem {__version__}")
    sub = parser.add_subparsers(dest="command_name", metavar="COMMAND")
    for command in commands:
        child = sub.add_parser(command.name, help=command.help, description=command.description or command.help)
        command.configure(child)
        child.set_defaults(command=command)
    return parser


def run(argv: Sequence[str] | None, ctx: CliContext, commands: Sequence[Command] = COMMANDS) -> int:
    """Parse ``argv`` and run the chosen command in ``ctx``; returns the exit code."""
    parser = build_parser(commands)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help/--version (0) and usage errors (2)
        return exc.code if isinstance(exc.code, int) else EXIT_BAD_INPUT
    command: Command | None = getattr(args, "command", None)
    if command is None:
        parser.print_help(ctx.stderr)
        return EXIT_BAD_INPUT
    try:
        return command.run(args, ctx)
    except INPUT_ERRORS as exc:
        print(f"error: {exc}", file=ctx.stderr)
        return EXIT_BAD_INPUT
    except ValidationError as exc:
        print(f"error: invalid settings: {exc}", file=ctx.stderr)
        return EXIT_BAD_INPUT
    except (TmemError, OSError) as exc:
        print(f"error: {exc}", file=ctx.stderr)
        return EXIT_FAILURE


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point (``tmem``, ``python -m tmem``). Every command runs with the library
    defaults of :func:`tmem.settings.apply_process_defaults` (no telemetry, models offline)."""
    from tmem.settings import apply_process_defaults

    apply_process_defaults()
    return run(argv, CliContext())
