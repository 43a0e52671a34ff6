"""``meshllm models pull hf:...`` against a local hub server (``HF_ENDPOINT``), through the real CLI.

The file lands in the library under its sha256, a second pull is instant (no request reaches the
hub, and it works offline), an interrupted pull resumes with a range request for the rest only, a
wrong repository or file is a clear error, and ``:QUANT`` picks the matching file.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hub_server import hub_server
from tinymodels import write_tiny_llama

from meshllm.models.library import Library

pytestmark = pytest.mark.timeout(120)
REPO = "tiny-org/tiny-llama-GGUF"


def pull(home: Path, hub_url: str, ref: str, *extra_env: tuple[str, str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update({"HF_ENDPOINT": hub_url, "HF_HUB_DISABLE_TELEMETRY": "1", **dict(extra_env)})
    return subprocess.run([sys.executable, "-m", "meshllm", "models", "pull", ref, "--home", str(home), "--json"],
                          capture_output=True, text=True, timeout=90, env=env)


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = write_tiny_llama(tmp_path_factory.mktemp("hub") / "t.gguf", n_layers=4, width=256, ffn=512, seed=2)
    return path.read_bytes()


def test_pull_lands_in_the_library_and_a_second_pull_is_instant(gguf: bytes, tmp_path: Path) -> None:
    with hub_server() as hub:
        hub.add(REPO, "tiny-llama-Q4_K_M.gguf", gguf)
        hub.add(REPO, "tiny-llama-Q8_0.gguf", gguf[:-7] + b"\x00" * 7)
        done = pull(tmp_path, hub.url, f"hf:{REPO}/tiny-llama-Q4_K_M.gguf")
        assert done.returncode == 0, done.stderr
        entry = json.loads(done.stdout)
        digest = hashlib.sha256(gguf).hexdigest()
        assert entry["id"] == digest and entry["name"] == "tiny-llama-Q4_K_M"
        assert Path(entry["path"]) == tmp_path / "models" / f"{digest}.gguf"
        assert Path(entry["path"]).read_bytes() == gguf
        (found,) = Library.for_home(tmp_path).entries()
        assert found.source == f"hf:{REPO}/tiny-llama-Q4_K_M.gguf"
        asked = len(hub.ranges)
        started = time.monotonic()
        again = pull(tmp_path, hub.url, f"hf:{REPO}/tiny-llama-Q4_K_M.gguf", ("HF_HUB_OFFLINE", "1"))
        assert again.returncode == 0, again.stderr
        assert json.loads(again.stdout)["id"] == digest and len(hub.ranges) == asked
        print(f"second pull: {time.monotonic() - started:.2f} s (interpreter start included), no hub request")
        # :QUANT picks the file whose name carries the quantization
        quant = pull(tmp_path, hub.url, f"hf:{REPO}:Q8_0")
        assert quant.returncode == 0, quant.stderr
        assert json.loads(quant.stdout)["name"] == "tiny-llama-Q8_0"


def test_an_interrupted_pull_resumes(tmp_path: Path) -> None:
    # a 28 MB file is 7 pieces of 4 MiB: interrupted once some are written, the next pull asks for the rest only
    gguf = write_tiny_llama(tmp_path / "big.gguf", n_layers=3, width=384, ffn=1536, seed=4).read_bytes()
    with hub_server() as hub:
        hub.add(REPO, "tiny.gguf", gguf)
        hub.throttle = 2_000_000  # bytes/s per connection: several seconds for the whole file
        env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_TELEMETRY": "1"}
        env.pop("HF_HUB_OFFLINE", None)
        first = subprocess.Popen([sys.executable, "-m", "meshllm", "models", "pull", f"hf:{REPO}/tiny.gguf",
                                  "--home", str(tmp_path)], env=env, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
        incoming = tmp_path / "models" / "incoming"

        def written() -> dict[str, str]:
            books = list(incoming.glob("*.pieces")) if incoming.exists() else []
            try:
                return json.loads(books[0].read_text())["pieces"] if books else {}
            except (OSError, ValueError):
                return {}

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not written():
            time.sleep(0.05)
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        hub.wait_idle(10)  # a request the killed pull had sent is recorded before the count below
        kept = {int(k) for k in written()}
        assert 0 < len(kept) < 7
        asked_before = len(hub.ranges)
        hub.throttle = None
        done = pull(tmp_path, hub.url, f"hf:{REPO}/tiny.gguf")
        assert done.returncode == 0, done.stderr
        assert Path(json.loads(done.stdout)["path"]).read_bytes() == gguf
        again = [int(r.split("=")[1].split("-")[0]) for r in hub.ranges[asked_before:] if r]
        assert again and not kept & set(again), (kept, again)  # only the pieces still missing were asked for
        assert len(again) == 7 - len(kept)
        assert not list(incoming.glob("*.part")) and not list(incoming.glob("*.pieces"))


def test_a_wrong_repo_or_file_is_a_clear_error(gguf: bytes, tmp_path: Path) -> None:
    with hub_server() as hub:
        hub.add(REPO, "tiny.gguf", gguf)
        for ref, words in (("hf:nobody/nothing/x.gguf", "no repository nobody/nothing"),
                           (f"hf:{REPO}/missing.gguf", f"{REPO} has no file missing.gguf"),
                           (f"hf:{REPO}:Q2_K", "no GGUF matching 'Q2_K'"),
                           ("hf:not a ref", "is not a Hugging Face reference")):
            done = pull(tmp_path, hub.url, ref)
            assert done.returncode == 1, (ref, done.stdout, done.stderr)
            assert words in done.stderr and "Traceback" not in done.stderr, done.stderr
        assert not Library.for_home(tmp_path).entries()


def test_a_pull_shows_plain_progress_lines_off_a_terminal(gguf: bytes, tmp_path: Path) -> None:
    with hub_server() as hub:
        hub.add(REPO, "tiny.gguf", gguf)
        done = pull(tmp_path, hub.url, f"hf:{REPO}/tiny.gguf")
        assert done.returncode == 0, done.stderr
        lines = [ln for ln in done.stderr.splitlines() if ln.startswith(f"pulling hf:{REPO}/tiny.gguf: ")]
        assert lines and lines[-1].split(": ")[1].startswith("100% (") and "\x1b" not in done.stderr, done.stderr
