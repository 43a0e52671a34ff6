"""``meshllm console``: open the running node's web console in the default browser.

The page is served by the node itself at ``/``. The node's admin token (``admin.token`` in its
home, when the node has one) rides in the URL *fragment*, ``#admin=TOKEN``: browsers never send a
fragment to the server, and the page moves it into the tab's session storage and out of the
address bar at once. ``--print`` prints the URL instead, for a browser on another machine or a
headless session.
"""

from __future__ import annotations

import webbrowser
from pathlib import Path
from urllib.parse import quote, urlsplit

import click
import httpx

from meshllm.cli.api_client import NodeApi, NodeApiError, unreachable
from meshllm.cli.common import api_option, home_dir
from meshllm.config import read_admin_token

CONSOLE_MARKER = b'name="generator" content="meshllm console"'
LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}


def page_token(api: str, home: Path) -> str:
    """The token to hand the page: the home's admin token, but only for a node on this machine.

    The token belongs to the node of ``home``; a page on another host must never receive it.
    """
    return (read_admin_token(home) or "") if urlsplit(api).hostname in LOOPBACK_HOSTS else ""


def console_url(api: str, token: str) -> str:
    """The page's URL, with ``token`` in the fragment when there is one."""
    return f"{api}/" + (f"#admin={quote(token, safe='')}" if token else "")


def check_console(api: str, timeout: float = 5.0) -> None:
    """Raise a meshllm error unless a node's console answers at ``api``."""
    try:
        response = httpx.get(api + "/", timeout=timeout, trust_env=False)
    except (httpx.ConnectError, httpx.ConnectTimeout):
        raise unreachable(api) from None
    except httpx.HTTPError as exc:
        raise NodeApiError(f"talking to {api} failed: {exc}") from None
    if response.status_code != 200 or CONSOLE_MARKER not in response.content:
        raise NodeApiError(f"{api} answered {response.status_code} but serves no meshllm console",
                           hint="check --api (or $MESHLLM_API); an older meshllm node has no console")


@click.command("console")
@api_option
@click.option("--print", "print_only", is_flag=True, help="Print the URL instead of opening a browser.")
def console(api: NodeApi, home: Path | None, print_only: bool) -> None:
    """Open the web console of the running node (map, models, live events, chat, owner actions).

    The page gets the node's admin token from --home, so management buttons work; a node at a
    remote --api gets no token from this machine's home: pass --api-key (its API key) instead.
    """
    check_console(api.url)
    token = api.secret if api.source == "--api-key" else page_token(api.url, home_dir(home, create=False))
    url = console_url(api.url, token or "")
    if print_only:
        click.echo(url)
        return
    if webbrowser.open(url):
        click.echo(f"opened the console of {api.url} in your browser" + ("" if token else " (read-only: no token)"))
    else:
        click.echo(f"no browser found; open this URL: {url}")
