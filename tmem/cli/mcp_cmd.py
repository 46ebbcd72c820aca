"""``tmem mcp [--http [--port 8765]] [--store DIR]``: the memory as an MCP server.

stdio by default (an assistant launches the command and speaks MCP on its stdin/stdout; logs go
to stderr); ``--http`` serves streamable HTTP at ``http://127.0.0.1:PORT/mcp``, where
``TMEM_API_KEY``, when set, is required as ``Authorization: Bearer <key>``. Tools and errors:
:mod:`tmem.query.mcp_server`.
"""

from __future__ import annotations

import argparse

from tmem.cli.base import CliContext, Command, add_store_option, resolve_store

DEFAULT_PORT = 8765


def run(args: argparse.Namespace, ctx: CliContext) -> int:
    import anyio  # imported here: keeps `tmem --help` light

    from tmem.ingest.spool import Spool
    from tmem.query.mcp_server import HOST, MCP_PATH, create_mcp_server, http_app
    from tmem.query.memory import Memory

    store = resolve_store(args, ctx)
    settings = ctx.settings().model_copy(update={"store": store})
    memory = Memory.open(store, settings, refresh_ms=args.refresh_ms)
    server = create_mcp_server(memory, Spool(store), settings)
    if not args.http:
        anyio.run(server.run_stdio_async)
        return 0
    import uvicorn

    print(f"tmem mcp: streamable HTTP at http://{HOST}:{args.port}{MCP_PATH}"
          f"{' (API key required)' if settings.api_key is not None else ''}", file=ctx.stderr)
    uvicorn.run(http_app(server, settings), host=HOST, port=args.port, log_level=args.log_level)
    return 0


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--http", action="store_true",
                        help=f"serve streamable HTTP on {'127.0.0.1'} instead of stdio")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"HTTP port (default {DEFAULT_PORT})")
    add_store_option(parser)
    parser.add_argument("--refresh-ms", type=int, default=500, metavar="MS",
                        help="check for a newer published snapshot at most this often (default 500)")
    parser.add_argument("--log-level", choices=("critical", "error", "warning", "info", "debug"), default="warning",
                        help="HTTP server log level (default warning)")


COMMAND = Command(
    name="mcp",
    help="serve the memory to assistants over MCP (stdio, or streamable HTTP on 127.0.0.1)",
    description=(
        "Expose search_memory, answer_question, list_conversations, get_scene, get_item and add_turns as "
        "Model Context Protocol tools over the store's published memory. stdio by default; --http serves "
        "http://127.0.0.1:PORT/mcp (TMEM_API_KEY, when set, is required as a Bearer token)."
    ),
    configure=configure,
    run=run,
)
