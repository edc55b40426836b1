"""Starts the whole Metronome system once per test session, the way a user does.

It runs `./dev up` (without rebuilding: `./dev test` has built the binaries) on free ports with
its state in a temporary folder, waits until the gateway is ready, and stops it with SIGTERM
afterwards. Nothing here talks to servers that were already running on the machine.
"""

import os
import pathlib
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODELS = ("sim-alpha", "sim-beta")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class System:
    def __init__(self, state_dir: pathlib.Path, gateway_port: int):
        self.state_dir = state_dir
        self.gateway_url = f"http://127.0.0.1:{gateway_port}"
        self.env = {}

    def load_env(self) -> None:
        for line in (self.state_dir / "env").read_text().splitlines():
            if "=" in line and not line.startswith("#"):
                key, value = line.removeprefix("export ").split("=", 1)
                self.env[key] = value.strip("'\"")

    @property
    def nats_url(self) -> str:
        return self.env["NATS_URL"]


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/readyz", timeout=1) as r:
            if r.status != 200:
                return False
        with urllib.request.urlopen(url + "/v1/models", timeout=1) as r:
            import json

            models = {m["id"] for m in json.load(r)["data"]}
            return set(MODELS) <= models
    except Exception:
        return False


@pytest.fixture(scope="session")
def system():
    state = pathlib.Path(tempfile.mkdtemp(prefix="metronome-pytest-"))
    port = _free_port()
    log = open(state / "up.log", "w")
    proc = subprocess.Popen(
        [str(ROOT / "dev"), "up", "--no-build", "--profile", "debug", "--gpus", "4",
         "--models", ",".join(MODELS), "--gateway-port", str(port), "--state-dir", str(state)],
        stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
    )
    sys_ = System(state, port)
    deadline = time.time() + 120
    try:
        # `./dev up` writes its env file once everything is ready.
        while not ((state / "env").exists() and _ready(sys_.gateway_url)):
            if proc.poll() is not None:
                raise RuntimeError(f"./dev up exited with {proc.returncode}:\n{(state / 'up.log').read_text()}")
            if time.time() > deadline:
                raise RuntimeError(f"system not ready in 120 s:\n{(state / 'up.log').read_text()}")
            time.sleep(0.2)
        sys_.load_env()
        yield sys_
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
