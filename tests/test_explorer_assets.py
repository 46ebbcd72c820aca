"""The explorer page's assets: served from the package under a strict CSP, nothing fetched from
elsewhere, no API that parses text as HTML, and carried by a wheel as package data."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from importlib.resources import files
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.query_store import HashEmbedder, build_store, make_conv
from tmem.explorer.routes import ASSET_TYPES
from tmem.query.memory import Memory
from tmem.query.service import create_app
from tmem.settings import Settings

REPO = Path(__file__).resolve().parents[1]
STATIC = files("tmem.explorer") / "static"
ASSETS = sorted(p.name for p in STATIC.iterdir() if p.is_file())
SCRIPTS = [n for n in ASSETS if n.endswith(".js")]
# Sinks that parse a string as HTML or code: a hostile id or memory text reaching one could run.
SINKS = re.compile(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|\beval\(|new Function|srcdoc|"
                   r"setAttribute\(\s*[\"']on|\.html\(")
SVG_NAMESPACE = "http://www.w3.org/2000/svg"


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> TestClient:
    store = tmp_path_factory.mktemp("assets") / "store"
    build_store(store, [make_conv("conv-a", mark="alpha", scenes=2)], HashEmbedder())
    settings = Settings(store=store)
    return TestClient(create_app(store, settings, memory=Memory.open(store, settings, embedder=HashEmbedder())))


def test_the_page_and_every_asset_it_references_are_served_with_a_strict_csp(client: TestClient) -> None:
    root = client.get("/", follow_redirects=False)
    assert root.status_code == 307 and root.headers["location"] == "/explorer/"
    page = client.get("/explorer/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp and "connect-src 'self'" in csp
    assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
    assert page.headers["x-content-type-options"] == "nosniff" and page.headers["referrer-policy"] == "no-referrer"
    referenced = set(re.findall(r'(?:src|href)="assets/([^"]+)"', page.text))
    for name in SCRIPTS:  # module imports between scripts
        referenced |= set(re.findall(r'from "\./([^"]+)"', (STATIC / name).read_text()))
    assert referenced and referenced <= set(ASSETS)
    assert set(ASSETS) - referenced <= {"index.html"}, "an asset nothing loads"
    for name in referenced:
        response = client.get(f"/explorer/assets/{name}")
        assert response.status_code == 200, name
        assert response.headers["content-type"] == ASSET_TYPES[Path(name).suffix]
        assert "content-security-policy" in response.headers
    for missing in ("nope.js", "..%2Froutes.py", "index.html"):
        assert client.get(f"/explorer/assets/{missing}").status_code == 404
    assert client.get("/explorer", follow_redirects=False).headers["location"] == "/explorer/"


@pytest.mark.parametrize("name", ASSETS)
def test_no_asset_fetches_anything_from_elsewhere(name: str) -> None:
    text = (STATIC / name).read_text(encoding="utf-8").replace(SVG_NAMESPACE, "")
    assert not re.search(r"(?:https?:)?//[a-z0-9.-]+\.[a-z]{2,}", text, re.IGNORECASE), name
    assert "@import" not in text and "url(" not in text.replace("url(data:", "")


@pytest.mark.parametrize("name", SCRIPTS)
def test_scripts_build_the_page_from_text_nodes_only(name: str) -> None:
    code = (STATIC / name).read_text(encoding="utf-8")
    assert not SINKS.search(code), f"{name}: {SINKS.search(code)}"
    assert "localStorage" not in code  # the key lives in sessionStorage: gone with the tab
    if name != "api.js":
        assert "sessionStorage" not in code and "Authorization" not in code  # the key stays inside api.js
    assert not re.search(r"[?&](?:key|token|api_key)=", code)  # never in a URL


def test_the_api_client_sends_the_key_as_a_bearer_header_only() -> None:
    code = (STATIC / "api.js").read_text(encoding="utf-8")
    assert "headers.Authorization = `Bearer ${key}`" in code
    assert 'credentials: "omit"' in code and "sessionStorage.setItem" in code


def test_a_wheel_carries_the_page(tmp_path: Path) -> None:
    """Built from a copy of the sources (setuptools writes build/ and *.egg-info beside them)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for package in ("tmem", "flows", "tasks"):
        shutil.copytree(REPO / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                    "-w", str(tmp_path / "dist"), str(src)], check=True, capture_output=True, timeout=300)
    [wheel] = (tmp_path / "dist").glob("tmem-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"tmem/explorer/static/{n}" for n in ASSETS} <= names
