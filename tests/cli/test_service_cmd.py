"""``meshllm service``: the unit ``--dry-run`` prints passes ``systemd-analyze verify``; the launchd
agent is a valid property list; flags that would fail the service (or leak a secret) are refused
before anything is written. Installing for real needs a user service manager (systemd --user or
launchd), which test machines do not run, so that path is not exercised here."""

from __future__ import annotations

import os
import plistlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from nodes import meshllm

from meshllm.cli.service import ServiceSpec, systemd_unit


def verify(unit: Path) -> subprocess.CompletedProcess[str]:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (Debian: apt-get install systemd)")
    return subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)


def test_dry_run_unit_passes_systemd_analyze(tmp_path: Path) -> None:
    home = tmp_path / "node home %h $X"
    done = meshllm("service", "install", "--dry-run", "--platform", "linux", "--home", str(home), "--",
                   "--model", "/models/a b.gguf", "--port", "9400", "--name", "alpha")
    assert done.returncode == 0, done.stderr
    unit = done.stdout
    for line in ("Restart=on-failure", "StandardOutput=journal", "WantedBy=default.target",
                 f'Environment="MESHLLM_HOME={tmp_path}/node home %%h $$X"'):
        assert line in unit.splitlines(), unit
    exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    assert exec_start.startswith(f"ExecStart={sys.executable} -m meshllm serve --home ")
    assert '"/models/a b.gguf" --port 9400 --name alpha' in exec_start
    path = tmp_path / "meshllm.service"
    path.write_text(unit)
    checked = verify(path)
    assert checked.returncode == 0 and "ignoring" not in checked.stderr.lower(), checked.stderr


def test_systemd_analyze_catches_a_broken_unit(tmp_path: Path) -> None:
    """The check above can fail: a unit whose ExecStart is a relative path is refused."""
    unit = systemd_unit(ServiceSpec("meshllm", tmp_path, python="bin/python"))
    path = tmp_path / "meshllm.service"
    path.write_text(unit)
    assert verify(path).returncode != 0


def test_dry_run_launchd_agent(tmp_path: Path) -> None:
    done = meshllm("service", "install", "--dry-run", "--platform", "macos", "--home", str(tmp_path), "--unit",
                   "beta", "--", "--client")
    assert done.returncode == 0, done.stderr
    agent = plistlib.loads(done.stdout.encode())
    assert agent["Label"] == "dev.meshllm.node.beta"
    assert agent["ProgramArguments"] == [sys.executable, "-m", "meshllm", "serve", "--home", str(tmp_path), "--client"]
    assert agent["KeepAlive"] == {"SuccessfulExit": False} and agent["RunAtLoad"] is True
    assert agent["EnvironmentVariables"]["MESHLLM_HOME"] == str(tmp_path)


@pytest.mark.parametrize(("flags", "message"), [
    (["--prot", "3"], "No such option '--prot'"),
    (["--api-key", "k" * 20], "--api-key-file"),
    (["--home", "/elsewhere"], "give --home before --"),
])
def test_bad_serve_flags_are_refused_before_writing(tmp_path: Path, flags: list[str], message: str) -> None:
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "meshllm", "service", "install", "--", *flags],
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert not any(tmp_path.iterdir())  # nothing written


def test_status_and_uninstall_without_a_service(tmp_path: Path) -> None:
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path)}
    for command in ("status", "uninstall"):
        done = subprocess.run([sys.executable, "-m", "meshllm", "service", command, "--platform", "linux"],
                              capture_output=True, text=True, timeout=60, env=env)
        assert done.returncode == 1 and "no service 'meshllm' is installed" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr


def test_an_encrypted_mesh_key_gets_a_warning(tmp_path: Path) -> None:
    env = {**os.environ, "MESHLLM_MESH_PASSPHRASE": "correct horse battery"}
    made = subprocess.run([sys.executable, "-m", "meshllm", "mesh", "create", "--encrypt", "--home", str(tmp_path)],
                          capture_output=True, text=True, timeout=60, env=env)
    assert made.returncode == 0, made.stderr
    done = meshllm("service", "install", "--dry-run", "--platform", "linux", "--home", str(tmp_path))
    assert done.returncode == 0 and "[Service]" in done.stdout
    assert "mesh key" in done.stderr and "MESHLLM_MESH_PASSPHRASE" in done.stderr
    joining = meshllm("service", "install", "--dry-run", "--platform", "linux", "--home", str(tmp_path), "--",
                      "--join", "TOKEN")
    assert joining.returncode == 0 and joining.stderr == ""  # a joining node does not use its own mesh key
