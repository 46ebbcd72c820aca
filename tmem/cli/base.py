"""What every ``tmem`` subcommand shares: the command record, the run context, common options.

A command module defines ``COMMAND = Command(...)`` and keeps its module-level imports light
(import heavy libraries inside ``run``), so that ``tmem --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TextIO

from tmem.settings import Settings, load_settings


def _utc_now() -> datetime:
    return datetime.now(UTC)


@dataclass
class CliContext:
    """The edges a command may touch: settings, output streams and the clock (record time)."""

    stdout: TextIO = field(default_factory=lambda: sys.stdout)
    stderr: TextIO = field(default_factory=lambda: sys.stderr)
    clock: Callable[[], datetime] = _utc_now
    settings_loader: Callable[[], Settings] = load_settings
    _settings: Settings | None = None

    def settings(self) -> Settings:
        """Settings are read from the environment on first use, not at import."""
        if self._settings is None:
            self._settings = self.settings_loader()
        return self._settings

    def print(self, text: str = "") -> None:
        print(text, file=self.stdout)

    def print_json(self, value: object) -> None:
        print(json.dumps(value, ensure_ascii=False, default=str), file=self.stdout)


@dataclass(frozen=True)
class Command:
    """One subcommand: its name, one-line help, argument setup and the function that runs it."""

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, CliContext], int]
    description: str = ""


def add_store_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--store",
        type=Path,
        default=None,
        metavar="DIR",
        help="store directory (default: $TMEM_STORE, else ./tmem-store)",
    )


def add_json_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def resolve_store(args: argparse.Namespace, ctx: CliContext) -> Path:
    """``--store`` if given, else the configured store."""
    store: Path | None = args.store
    return store if store is not None else ctx.settings().store
