"""A real Prefect server for benchmarks: SQLite or PostgreSQL, with its API requests counted.

``python bench/prefect_servers.py serve --port P`` runs the app ``prefect server start`` runs
(``prefect.server.api.server:create_app(final=True)``: API, UI and background services, under
uvicorn) wrapped in an ASGI counter: every HTTP request by method and route (ids replaced by
``{id}``) and every websocket message a client sends (events, logs), readable at
``GET /__bench/counts``. Its database is ``PREFECT_SERVER_DATABASE_CONNECTION_URL`` (default:
SQLite under ``PREFECT_HOME``).

:class:`Postgres` runs Debian's PostgreSQL (``apt-get install postgresql``) from a temporary data
directory as the ``postgres`` user (initdb refuses root) on a free local port.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

PG_BIN = Path("/usr/lib/postgresql/15/bin")
_ID = re.compile(r"/[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class CountingApp:
    """ASGI middleware: counts HTTP requests per route and websocket messages received per path."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app
        self.counts: Counter[str] = Counter()

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:
        if scope["type"] == "http" and scope["path"] == "/__bench/counts":
            body = json.dumps(dict(self.counts)).encode()
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": body})
            return
        if scope["type"] == "http":
            self.counts["http"] += 1
            self.counts[f"{scope['method']} {_ID.sub('/{id}', scope['path'])}"] += 1
        elif scope["type"] == "websocket":
            path = scope["path"]
            self.counts[f"ws-connect {path}"] += 1

            async def counted() -> Message:
                message = await receive()
                if message["type"] == "websocket.receive":
                    self.counts["ws_messages"] += 1
                    self.counts[f"ws {path}"] += 1
                return message

            await self.app(scope, counted, send)
            return
        await self.app(scope, receive, send)


def serve(port: int) -> None:
    import uvicorn
    from prefect.server.api.server import create_app

    uvicorn.run(CountingApp(create_app(final=True)), host="127.0.0.1", port=port, log_level="warning",
                timeout_keep_alive=5)


def counts(api_url: str) -> Counter[str]:
    base = api_url.removesuffix("/api")
    with urllib.request.urlopen(f"{base}/__bench/counts", timeout=30) as response:
        return Counter(json.loads(response.read()))


class PrefectServer:
    """``serve`` in a subprocess with ``env`` (PREFECT_HOME, database URL); ``api_url`` once healthy."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.port = free_port()
        self.api_url = f"http://127.0.0.1:{self.port}/api"
        self._log = log.open("w")
        self.proc = subprocess.Popen([sys.executable, __file__, "serve", "--port", str(self.port)], env=env,
                                     stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"{self.api_url}/health", timeout=5):
                    break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the Prefect server did not start; see {log}") from None
                time.sleep(0.5)

    def counts(self) -> Counter[str]:
        return counts(self.api_url)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self._log.close()


class Postgres:
    """A throwaway PostgreSQL cluster in ``root`` (trust auth on 127.0.0.1), owned by ``postgres``."""

    def __init__(self, root: Path) -> None:
        if not (PG_BIN / "initdb").exists():
            raise SystemExit("PostgreSQL is not installed: apt-get install -y postgresql")
        self.root = root
        self.data = root / "data"
        self.port = free_port()
        root.mkdir(parents=True, exist_ok=True)
        shutil.chown(root, "postgres", "postgres")
        self._as_postgres([str(PG_BIN / "initdb"), "-D", str(self.data), "--auth=trust", "-U", "postgres", "-E", "UTF8"])
        self._as_postgres([str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-l", str(root / "postgres.log"), "-w", "-o",
                           f"-p {self.port} -k {root} -c listen_addresses=127.0.0.1 -c max_connections=200", "start"])
        self._as_postgres([str(PG_BIN / "createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "prefect"])
        self.url = f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/prefect"

    def _as_postgres(self, command: list[str]) -> None:
        run = ["runuser", "-u", "postgres", "--", *command] if os.geteuid() == 0 else command
        subprocess.run(run, check=True, capture_output=True, cwd="/tmp")

    def stop(self) -> None:
        self._as_postgres([str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("serve")
    run.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    if args.command == "serve":
        serve(args.port)


if __name__ == "__main__":
    main()
