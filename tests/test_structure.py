"""The wiring rules of the code base (STYLE.md §1, §3-§5; issue 14), checked from the source itself.

* ``tmem/`` never imports Prefect, ``flows/`` or ``tasks/``; only ``tmem/store/`` imports duckdb or lancedb (type-only
  imports under ``TYPE_CHECKING`` aside);
* no module under ``tasks/`` imports ``flows/``;
* the environment is read only by ``tmem/settings.py`` and the process entry points;
* every Prefect task takes plain values — ids, paths, times, the build spec, the data a build
  produced — never a connection, a client, a runtime or the settings object, and reads no
  settings of its own: a task's runtime is opened from its inputs (``runtime_for(spec, run_id,
  ...)`` with its own parameters), never looked up from the environment or a global.

Run alone: ``pytest tests/test_structure.py``.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import types
import typing
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from tests.paths import REPO

# Process entry points, which may set the environment for the libraries they drive.
ENVIRONMENT_READERS = {"tmem/settings.py", "tmem/demo.py"}
STORE_ONLY = {"duckdb", "lancedb", "lance"}
FLOW_STARTERS = ("tmem/cli/", "tmem/demo.py")


def sources(*roots: str) -> Iterator[tuple[str, ast.Module]]:
    for root in roots:
        for path in sorted((REPO / root).rglob("*.py")):
            yield str(path.relative_to(REPO)), ast.parse(path.read_text(encoding="utf-8"))


def runtime_imports(tree: ast.Module) -> Iterator[tuple[int, str]]:
    """(line, module) of every import that runs (not under ``if TYPE_CHECKING:``)."""
    type_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                 for n in ast.walk(node)}
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module


def test_the_library_imports_no_prefect_and_only_its_store_imports_the_databases() -> None:
    # flows/ and tasks/ wrap the library, so the library never reaches back into them either; only
    # the process entry points (the CLI, the demo) start a flow.
    found = [f"{path}:{line} {module}" for path, tree in sources("tmem") for line, module in runtime_imports(tree)
             if module.split(".")[0] in {"prefect", "prefect_dask"}
             or (module.split(".")[0] in {"flows", "tasks"} and not path.startswith(FLOW_STARTERS))
             or (module.split(".")[0] in STORE_ONLY and not path.startswith("tmem/store/"))]
    assert found == []


def test_no_task_module_imports_a_flow() -> None:
    found = [f"{path}:{line} {module}" for path, tree in sources("tasks") for line, module in runtime_imports(tree)
             if module.split(".")[0] == "flows"]
    found += [f"{path}:{line} {module}" for path, tree in sources("tasks")
              for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
              for line, module in [(node.lineno, node.module)] if module.startswith("flows")]
    assert found == []


def test_only_the_settings_module_and_entry_points_touch_the_environment() -> None:
    found = []
    for path, tree in sources("tmem", "tasks", "flows", "deployments"):
        if path in ENVIRONMENT_READERS:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os" and \
                    node.attr in {"environ", "getenv", "putenv", "unsetenv", "environb"}:
                found.append(f"{path}:{node.lineno} os.{node.attr}")
            if isinstance(node, ast.ImportFrom) and node.module == "os" and \
                    {a.name for a in node.names} & {"environ", "getenv", "putenv", "environb"}:
                found.append(f"{path}:{node.lineno} from os import ...")
    assert found == []


def task_functions() -> Iterator[tuple[str, Any]]:
    from prefect import Task

    for path in sorted((REPO / "tasks").glob("*.py")):
        module = importlib.import_module(f"tasks.{path.stem}")
        for name, value in vars(module).items():
            if isinstance(value, Task) and value.fn.__module__ == module.__name__:
                yield f"tasks.{path.stem}.{name}", value.fn


def plain(annotation: Any) -> bool:
    """Built only of values that serialise: scalars, times, paths, the build spec, a build's data."""
    from tmem.build.conversation import ConversationBuild
    from tmem.build.spec import BuildSpec

    leaves = (str, int, float, bool, type(None), datetime, Path, BuildSpec, ConversationBuild)
    if annotation in leaves:
        return True
    origin = typing.get_origin(annotation)
    if origin in (list, tuple, dict, types.UnionType, typing.Union):
        return all(plain(a) for a in typing.get_args(annotation) if a is not Ellipsis)
    return False


def test_every_task_takes_plain_values_and_opens_its_runtime_from_them() -> None:
    tasks = dict(task_functions())
    assert {"tasks.build.build_conversation_task", "tasks.publish.publish", "tasks.maintenance.drain_posted_turns",
            "tasks.maintenance.optimize_vector_tables"} <= set(tasks)
    wrong = [f"{name}({param}: {hint})" for name, fn in tasks.items()
             for param, hint in typing.get_type_hints(fn).items() if param != "return" and not plain(hint)]
    assert wrong == []
    for name, fn in tasks.items():
        tree = ast.parse(inspect.getsource(fn).lstrip())
        params = set(inspect.signature(fn).parameters)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in {"load_settings", "Settings"}, f"{name} reads settings of its own"
                if node.func.id == "runtime_for":
                    used = {n.id for arg in node.args for n in ast.walk(arg) if isinstance(n, ast.Name)}
                    assert used <= params, f"{name} opens a runtime from {used - params}, not from its inputs"
