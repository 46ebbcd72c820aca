"""The memory explorer of ``tmem serve``: a read-only web page over the published snapshot.

``routes`` serves the page (``static/``: plain HTML, JS and CSS shipped as package data) and its
JSON API under ``/explorer/api``; ``views`` turns memory, traces and run records into the shapes
of ``schemas``. Only :mod:`tmem.store` touches DuckDB; nothing here opens ``work.duckdb``.
"""
