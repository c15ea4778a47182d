"""Start ``cascade serve`` in a subprocess on a free loopback port, and stop it again."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import http.client

from proc_util import stop

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
# the console script's entry point, without relying on a `cascade` executable on PATH
_MAIN = "import sys; from cascade.cli import main; sys.exit(main())"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """A running server: ``url`` (``http://127.0.0.1:PORT``), ``base`` (``.../v1``), its log."""

    def __init__(self, proc: subprocess.Popen, port: int, log: Path):
        self.proc, self.port, self.log = proc, port, log
        self.url = f"http://127.0.0.1:{port}"
        self.base = self.url + "/v1"

    def request(self, method: str, path: str, body=None) -> "Reply":
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            data = body if body is None or isinstance(body, (str, bytes)) else json.dumps(body)
            conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            return Reply(resp.status, resp.headers, resp.read().decode())  # headers: case-insensitive
        finally:
            conn.close()

    def get(self, path: str) -> "Reply":
        return self.request("GET", path)

    def post(self, path: str, body) -> "Reply":
        return self.request("POST", path, body)

    def open_stream(self, path: str, body: dict) -> "Stream":
        """A streaming POST whose server-sent events are read one at a time; close() it to
        disconnect in the middle."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        conn.request("POST", path, body=json.dumps({**body, "stream": True}),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        return Stream(conn, resp)

    def leave_early(self, path: str, body: dict) -> "Stream":
        """Send a request without reading its answer; close() the result to disconnect."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        return Stream(conn, None)

    def health(self) -> dict:
        return self.get("/health").json()

    def wait_for(self, predicate, timeout: float = 30.0, what: str = "condition") -> dict:
        """Poll /health until ``predicate(health)`` holds; return that health."""
        deadline = time.monotonic() + timeout
        while True:
            h = self.health()
            if predicate(h):
                return h
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; last /health: {h}")
            time.sleep(0.05)

    def metric(self, name: str, **labels) -> float:
        """The value of one sample in /metrics (0 when absent)."""
        from prometheus_client.parser import text_string_to_metric_families

        for family in text_string_to_metric_families(self.get("/metrics").text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return sample.value
        return 0.0


class Reply:
    def __init__(self, status: int, headers, text: str):
        self.status_code, self.headers, self.text = status, headers, text

    def json(self):
        return json.loads(self.text)


class Stream:
    def __init__(self, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse):
        self.conn, self.resp = conn, resp

    def next_event(self) -> str:
        """The next ``data:`` payload (``[DONE]`` at the end)."""
        while True:
            line = self.resp.readline()
            if not line:
                raise EOFError("stream ended without [DONE]")
            line = line.decode().strip()
            if line.startswith("data: "):
                return line[len("data: "):]

    def events(self) -> list[str]:
        out = []
        while not out or out[-1] != "[DONE]":
            out.append(self.next_event())
        return out

    def close(self) -> None:
        self.conn.sock.shutdown(socket.SHUT_RDWR)  # the client goes away: the server sees EOF
        self.conn.close()


@contextlib.contextmanager
def serve(topology: Path, *args: str, log_dir: Path, timeout: float = 180.0) -> Iterator[Served]:
    """``cascade serve -t topology *args`` until the block ends; the process is always stopped
    and its port checked free."""
    port = free_port()
    log = log_dir / f"serve-{port}.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-c", _MAIN, "serve", "-t", str(topology), "--port", str(port),
           "--log-level", "warning", *args]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    served = Served(proc, port, log)
    try:
        _wait_up(served, timeout)
        yield served
    finally:
        stop(proc, timeout=30)
        with socket.socket() as s:  # nothing is left listening on the port
            assert s.connect_ex(("127.0.0.1", port)) != 0, f"port {port} still open after the server stopped"


def _wait_up(served: Served, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if served.proc.poll() is not None:
            raise RuntimeError(f"cascade serve exited with {served.proc.returncode}:\n{served.log.read_text()}")
        try:
            if served.get("/health").status_code == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"cascade serve did not come up in {timeout:.0f} s:\n{served.log.read_text()}")
