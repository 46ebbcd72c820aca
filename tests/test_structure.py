"""The wiring rules of the code base (STYLE.md §1, §3-§5; issue 14), checked from the source itself.

* the library (``tmem/`` but its Prefect wrappers) never imports Prefect, ``tmem.flows`` or ``tmem.tasks``; only
  ``tmem/store/`` imports duckdb or lancedb (type-only imports under ``TYPE_CHECKING`` aside);
* only ``tmem/providers/`` imports the model libraries (openai, sentence-transformers, llama.cpp);
* the core (domain, ports, prompts, construction, retrieval, the evaluation's metrics) imports no
  adapter, store, Prefect wrapper or edge; the call layer ``tmem/llm/`` imports neither adapters
  nor the store; ``tmem/providers/`` holds adapters that import only the ports and their settings;
* no import loop anywhere (type-only and function-level imports count: a loop is a loop to a reader);
* no module under ``tasks/`` imports ``flows/``;
* the Prefect wrappers live in the checkout's ``flows/`` and ``tasks/`` and ship as ``tmem.flows`` and ``tmem.tasks``
  (``tmem/flows`` and ``tmem/tasks`` link to them): the built wheel holds them there and no top-level package but
  ``tmem``, and every ``prefect.yaml`` entry point loads from the checkout;
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
ENVIRONMENT_READERS = {"tmem/settings.py"}
STORE_ONLY = {"duckdb", "lancedb", "lance"}
MODEL_LIBRARIES = {"openai", "sentence_transformers", "transformers", "torch", "llama_cpp"}
# The core: what the product is made of, independent of how it is stored, served or scheduled.
CORE = ("tmem/domain.py", "tmem/ids.py", "tmem/errors.py", "tmem/ports.py", "tmem/prompts/", "tmem/construct/",
        "tmem/retrieval/", "tmem/views/catalog.py", "tmem/views/texts.py", "tmem/eval/f1.py", "tmem/eval/nlp.py", "tmem/eval/retrieval_metrics.py", "tmem/eval/judge.py")
OUTSIDE_THE_CORE = ("tmem.providers", "tmem.store", "tmem.llm", "tmem.bundle", "tmem.build", "tmem.query",
                    "tmem.cli", "tmem.devtools", "tmem.tasks", "tmem.flows", "deployments")
# What an adapter may import of tmem: the ports, the errors and ids, the prompts it renders, its settings.
ADAPTER_IMPORTS = ("tmem.ports", "tmem.errors", "tmem.ids", "tmem.prompts", "tmem.settings", "tmem.providers")
PACKAGES = ("tmem", "flows", "tasks", "deployments")
# The checkout's folders of Prefect wrappers and the names they ship (and are imported) as.
WRAPPERS = {"flows": "tmem.flows", "tasks": "tmem.tasks"}
FLOW_STARTERS = ("tmem/cli/", "tmem/demo.py")


def sources(*roots: str) -> Iterator[tuple[str, ast.Module]]:
    """Every module under the roots, each once: ``tmem/flows`` and ``tmem/tasks`` are links to the
    checkout's ``flows/`` and ``tasks/``, which are read as themselves (root ``flows``, ``tasks``)."""
    for root in roots:
        for path in sorted((REPO / root).rglob("*.py")):
            if path.resolve().is_relative_to((REPO / root).resolve()):
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


def module_name(path: str) -> str:
    parts = Path(path).with_suffix("").parts
    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    top, dot, rest = name.partition(".")
    return WRAPPERS[top] + dot + rest if top in WRAPPERS else name


def every_import(path: str, tree: ast.Module) -> Iterator[tuple[int, str]]:
    """(line, module) of every import, type-only and function-level ones too, relative ones resolved;
    ``from package import name`` names ``package.name`` too (it may be a module)."""
    package = module_name(path) if path.endswith("__init__.py") else module_name(path).rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            yield node.lineno, module
            yield from ((node.lineno, f"{module}.{a.name}") for a in node.names)


def within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_only_the_adapters_import_the_model_libraries() -> None:
    found = [f"{path}:{line} {module}" for path, tree in sources(*PACKAGES) for line, module in runtime_imports(tree)
             if module.split(".")[0] in MODEL_LIBRARIES and not path.startswith("tmem/providers/")]
    assert found == []


def test_the_core_imports_no_adapter_store_wrapper_or_edge() -> None:
    found = [f"{path}:{line} {module}" for path, tree in sources("tmem") if path.startswith(CORE)
             for line, module in every_import(path, tree) if within(module, OUTSIDE_THE_CORE)]
    assert found == []


def test_the_call_layer_and_the_adapters_stay_apart() -> None:
    found = [f"{path}:{line} {module}" for path, tree in sources("tmem/llm") for line, module in every_import(path, tree)
             if within(module, ("tmem.providers", "tmem.store", "tmem.bundle", "tmem.build"))]
    found += [f"{path}:{line} {module}" for path, tree in sources("tmem/providers")
              for line, module in every_import(path, tree)
              if module.split(".")[0] == "tmem" and module != "tmem" and not within(module, ADAPTER_IMPORTS)]
    assert found == []


def import_graph() -> dict[str, set[str]]:
    trees = dict(sources(*PACKAGES))
    modules = {module_name(path) for path in trees}
    graph: dict[str, set[str]] = {}
    for path, tree in trees.items():
        here = module_name(path)
        targets = set()
        for _, module in every_import(path, tree):
            while module and module not in modules:  # a name inside a module: the module
                module = module.rpartition(".")[0]
            if module and module != here and not here.startswith(module + "."):  # a package's own face
                targets.add(module)
        graph[here] = targets
    return graph


def import_loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    loops: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        loops.append(sorted(component))
    return loops


def test_import_loops_are_found() -> None:
    assert import_loops({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_loops({"a": {"b"}, "b": set()}) == []


def test_no_import_loop_anywhere() -> None:
    assert import_loops(import_graph()) == []


def test_the_library_imports_no_prefect_and_only_its_store_imports_the_databases() -> None:
    # tmem.flows and tmem.tasks wrap the library, so the library never reaches back into them either;
    # only the process entry points (the CLI, the demo) start a flow.
    found = [f"{path}:{line} {module}" for path, tree in sources("tmem") for line, module in runtime_imports(tree)
             if module.split(".")[0] in {"prefect", "prefect_dask"}
             or (within(module, tuple(WRAPPERS.values())) and not path.startswith(FLOW_STARTERS))
             or (module.split(".")[0] in STORE_ONLY and not path.startswith("tmem/store/"))]
    assert found == []


def test_no_task_module_imports_a_flow() -> None:
    found = [f"{path}:{line} {module}" for path, tree in sources("tasks") for line, module in every_import(path, tree)
             if within(module, ("tmem.flows", "flows"))]
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
        module = importlib.import_module(f"tmem.tasks.{path.stem}")
        for name, value in vars(module).items():
            if isinstance(value, Task) and value.fn.__module__ == module.__name__:
                yield f"tmem.tasks.{path.stem}.{name}", value.fn


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
    assert {"tmem.tasks.build.build_conversation_task", "tmem.tasks.publish.publish",
            "tmem.tasks.maintenance.drain_posted_turns", "tmem.tasks.maintenance.optimize_vector_tables"} <= set(tasks)
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


def test_the_cascade_budgets_are_declared_once() -> None:
    from tmem.retrieval.config import RetrievalConfig, config_from_settings
    from tmem.settings import CascadeBudgets, Settings, load_settings

    assert issubclass(RetrievalConfig, CascadeBudgets) and issubclass(Settings, CascadeBudgets)
    k0, rrf_k0 = RetrievalConfig.model_fields["k0"], Settings.model_fields["rrf_k0"]
    assert (k0.default, k0.metadata) == (rrf_k0.default, rrf_k0.metadata)
    assert config_from_settings(load_settings(k_scenes=0, rrf_k0=30)).model_dump(include={"k_scenes", "k0"}) == \
        {"k_scenes": 0, "k0": 30}


def test_the_wheel_ships_what_the_cli_imports_and_the_deployments_load_from_the_checkout(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys
    import tomllib

    import yaml
    from setuptools import find_packages

    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    packages = find_packages(str(REPO), include=config["tool"]["setuptools"]["packages"]["find"]["include"])
    # the console script `tmem build` imports tmem.flows, and a console script has no checkout on its path;
    # site-packages gets no top-level package but tmem
    assert {p.split(".")[0] for p in packages} == {"tmem"}
    for folder, name in WRAPPERS.items():
        assert (REPO / name.replace(".", "/")).resolve() == REPO / folder and name in packages
    cli_flows = {m for path, tree in sources("tmem") for _, m in runtime_imports(tree) if within(m, ("tmem.flows",))}
    assert cli_flows and all(m.rpartition(".")[0] in packages for m in cli_flows)
    assert {"tmem.llm", "tmem.providers", "tmem.query", "tmem.store", "tmem.build"} <= set(packages)

    entrypoints = [d["entrypoint"] for d in yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]]
    assert entrypoints and all(e.startswith("flows/") for e in entrypoints)
    script = ("import json, sys\nfrom prefect.flows import load_flow_from_entrypoint\n"
              "flows = [load_flow_from_entrypoint(e) for e in sys.argv[1:]]\n"
              "print(json.dumps([[f.name, sys.modules[f.fn.__module__].__file__] for f in flows]))")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PREFECT_HOME": str(tmp_path / "prefect"),
           "DO_NOT_TRACK": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    done = subprocess.run([sys.executable, "-c", script, *entrypoints], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(loaded) == len(entrypoints)
    assert all(Path(file).resolve().is_relative_to(REPO) for _, file in loaded), loaded


def test_the_built_wheel_holds_the_wrappers_under_tmem_and_no_other_top_level_package(tmp_path: Path) -> None:
    """A real wheel, built from a copy of the checkout's sources (links kept as links, as git stores them)."""
    import shutil
    import subprocess
    import sys
    import zipfile

    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for folder in ("tmem", *WRAPPERS):
        shutil.copytree(REPO / folder, source / folder, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    assert (source / "tmem" / "flows").is_symlink()
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                           "-w", str(tmp_path / "wheel"), str(source)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    [wheel] = (tmp_path / "wheel").glob("tmem-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"tmem"}
    for folder, name in WRAPPERS.items():
        shipped = {n.removeprefix(name.replace(".", "/") + "/") for n in names if n.startswith(name.replace(".", "/") + "/")}
        assert shipped == {p.name for p in (REPO / folder).glob("*.py")}  # every module, as files
    assert "tmem/explorer/static/index.html" in names
