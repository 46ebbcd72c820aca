"""``tmem snapshot upgrade [--store DIR] [--json]``: rewrite the current snapshot in the current format.

Readers refuse a snapshot of an older format with a message naming this command
(:mod:`tmem.store.snapshot.formats`); the upgrade derives a new current snapshot from the old one
alone (:mod:`tmem.store.snapshot.upgrade`). It holds the working database open for writing while
it runs, so no build publishes meanwhile. Exit status 0 upgraded or already current; 2 nothing
published, a newer format, or a build holding the store.
"""

from __future__ import annotations

import argparse

from tmem.cli.base import CliContext, Command, add_json_option, add_store_option, resolve_store


def configure(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="snapshot_action", metavar="ACTION", required=True)
    upgrade = actions.add_parser("upgrade", help="rewrite the current snapshot, published in an older format, "
                                                 "in the current one and point readers at it")
    add_store_option(upgrade)
    add_json_option(upgrade)


def run(args: argparse.Namespace, ctx: CliContext) -> int:
    from tmem.store.duck import connect, work_db_path
    from tmem.store.snapshot.formats import IMAGE_FORMAT, format_name
    from tmem.store.snapshot.upgrade import upgrade_current_snapshot

    store = resolve_store(args, ctx)
    # The builder's lock: a publish between reading CURRENT and flipping it would be undone.
    lock = connect(store) if work_db_path(store).exists() else None
    try:
        done = upgrade_current_snapshot(store, now=ctx.clock(), image_vectors=ctx.settings().snapshot_image_vectors)
    finally:
        if lock is not None:
            lock.close()
    if args.json:
        ctx.print_json(done.as_dict())
    elif done.upgraded is None:
        ctx.print(f"snapshot {done.snapshot_id} is of the current format already: nothing to do")
    else:
        ctx.print(f"snapshot {done.snapshot_id} (format {format_name(done.from_format)}) upgraded to "
                  f"{done.upgraded.snapshot_id} (format {IMAGE_FORMAT}, {done.images} images); readers now use it")
    return 0


COMMAND = Command(
    name="snapshot",
    help="published snapshots: `tmem snapshot upgrade` rewrites an older-format current snapshot",
    configure=configure,
    run=run,
)
