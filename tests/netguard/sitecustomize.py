"""Network guard for tests/test_privacy.py: records every outgoing connection attempt of a process.

Put this directory first on ``PYTHONPATH`` and set ``NETGUARD_DIR``: Python imports
``sitecustomize`` at start-up, so every Python process of the run — the ``tmem`` commands and
anything they start, such as Prefect's temporary API server — appends JSON lines to
``NETGUARD_DIR/<pid>.jsonl``: ``start`` (argv and the telemetry switches of its environment),
``resolve`` (every name looked up), ``connect`` (every socket connect, with the switches at that
moment) and ``exit``. Connections still happen; the test decides what was allowed. Only the
switches listed in ``SWITCHES`` are recorded, never other variables (they may hold secrets).
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import threading
from typing import Any

SWITCHES = ("DO_NOT_TRACK", "PREFECT_SERVER_ANALYTICS_ENABLED", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
_DIR = os.environ.get("NETGUARD_DIR")
_LOCK = threading.Lock()


def _switches() -> dict[str, str | None]:
    return {name: os.environ.get(name) for name in SWITCHES}


def _write(event: dict[str, Any]) -> None:
    event["pid"] = os.getpid()
    line = json.dumps(event, default=repr) + "\n"
    with _LOCK, open(os.path.join(str(_DIR), f"{os.getpid()}.jsonl"), "a", encoding="utf-8") as fh:
        fh.write(line)


def _address(address: Any) -> Any:
    if isinstance(address, bytes):
        return address.decode(errors="replace")
    if isinstance(address, tuple):
        return [_address(part) for part in address]
    return address


def _install() -> None:
    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex
    real_getaddrinfo, real_gethostbyname = socket.getaddrinfo, socket.gethostbyname

    def connect(self: socket.socket, address: Any) -> None:
        _write({"event": "connect", "family": int(self.family), "address": _address(address), "env": _switches()})
        real_connect(self, address)

    def connect_ex(self: socket.socket, address: Any) -> int:
        _write({"event": "connect", "family": int(self.family), "address": _address(address), "env": _switches()})
        return real_connect_ex(self, address)

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        _write({"event": "resolve", "host": _address(host)})
        return real_getaddrinfo(host, *args, **kwargs)

    def gethostbyname(host: str) -> str:
        _write({"event": "resolve", "host": host})
        return real_gethostbyname(host)

    socket.socket.connect = connect  # type: ignore[method-assign,assignment]
    socket.socket.connect_ex = connect_ex  # type: ignore[method-assign,assignment]
    socket.getaddrinfo = getaddrinfo
    socket.gethostbyname = gethostbyname
    _write({"event": "start", "argv": list(getattr(sys, "orig_argv", [])), "env": _switches()})
    atexit.register(lambda: _write({"event": "exit", "env": _switches()}))


if _DIR:
    _install()
