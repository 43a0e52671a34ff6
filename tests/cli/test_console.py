"""``meshllm console`` without a node: the URL it builds, the token it hands out, and its errors.

With a running node (opening the browser, ``--print``) it is tested in tests/console/.
"""

from __future__ import annotations

from pathlib import Path

from api.api_server import serve
from fastapi import FastAPI
from nodes import meshllm

from meshllm.cli.console import console_url, page_token
from meshllm.config import ADMIN_TOKEN_FILE


def test_the_token_rides_in_the_fragment_and_is_escaped() -> None:
    assert console_url("http://127.0.0.1:9337", "") == "http://127.0.0.1:9337/"
    assert console_url("http://127.0.0.1:9337", "a/b c#d") == "http://127.0.0.1:9337/#admin=a%2Fb%20c%23d"


def test_only_a_node_on_this_machine_gets_the_homes_admin_token(tmp_path: Path) -> None:
    assert page_token("http://127.0.0.1:9337", tmp_path) == ""  # no token file: read-only page
    (tmp_path / ADMIN_TOKEN_FILE).write_text("secret-token-0123456789\n")
    for local in ("http://127.0.0.1:9337", "http://localhost:1", "http://[::1]:9337"):
        assert page_token(local, tmp_path) == "secret-token-0123456789"
    assert page_token("http://10.1.2.3:9337", tmp_path) == ""
    assert page_token("https://mesh.example.org", tmp_path) == ""


def test_no_node_is_a_one_line_error(tmp_path: Path) -> None:
    done = meshllm("console", "--print", "--api", "http://127.0.0.1:9", "--home", str(tmp_path))
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith("error: no meshllm node is running at http://127.0.0.1:9")
    assert "Traceback" not in done.stderr


def test_a_server_without_the_console_is_refused(tmp_path: Path) -> None:
    with serve(FastAPI()) as url:
        done = meshllm("console", "--print", "--api", url, "--home", str(tmp_path))
    assert done.returncode == 1 and "serves no meshllm console" in done.stderr


def test_a_bad_api_url_is_a_usage_error(tmp_path: Path) -> None:
    done = meshllm("console", "--api", "127.0.0.1:9337", "--home", str(tmp_path))
    assert done.returncode == 2 and "is not an http:// or https:// URL" in done.stderr
