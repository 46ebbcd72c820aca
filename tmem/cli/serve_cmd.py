"""``tmem serve [--host 127.0.0.1] [--port 8000] [--store DIR]``: the HTTP query service.

Serves ``/health``, ``/search`` and ``/answer`` (OpenAPI at ``/docs`` and ``/openapi.json``) and
the memory explorer page at ``/`` over the store's published snapshot, switching to a newer
snapshot without a restart. Set ``TMEM_API_KEY`` to require ``Authorization: Bearer <key>`` (the
explorer asks for it once per browser tab). The query embedding model is loaded before the port
opens (``--no-warm-up`` skips that), so no request waits on a cold load.
"""

from __future__ import annotations

import argparse

from tmem.cli.base import CliContext, Command, add_store_option, resolve_store

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def run(args: argparse.Namespace, ctx: CliContext) -> int:
    import uvicorn  # imported here: keeps `tmem --help` light

    from tmem.query.service import create_app

    app = create_app(resolve_store(args, ctx), ctx.settings(), refresh_ms=args.refresh_ms)
    if args.warm_up:
        # Load the query embedder before the port opens: a cold load takes seconds (minutes on a
        # busy machine), and the first hybrid queries would otherwise all wait on it.
        app.state.memory.embed_query("warm-up")
    shown = f"[{args.host}]" if ":" in args.host else args.host
    print(f"memory explorer: http://{shown}:{args.port}/", file=ctx.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=args.access_log)
    return 0


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    add_store_option(parser)
    parser.add_argument("--refresh-ms", type=int, default=500, metavar="MS",
                        help="check for a newer published snapshot at most this often (default 500)")
    parser.add_argument("--warm-up", action=argparse.BooleanOptionalAction, default=True,
                        help="load the query embedding model before accepting requests (default on)")
    parser.add_argument("--log-level", choices=LOG_LEVELS, default="info")
    parser.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True,
                        help="log every request (default on)")


COMMAND = Command(
    name="serve",
    help="serve /search, /answer, /health and the memory explorer (/) over HTTP",
    description=(
        "Run the query service and the memory explorer page on the store's published memory. A newer "
        "snapshot is picked up without restarting; every response names the snapshot it came from."
    ),
    configure=configure,
    run=run,
)
