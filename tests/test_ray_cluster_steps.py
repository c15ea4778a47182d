"""The README's cluster steps, tried as a new user would, on a machine where the local Ray backend
has already run (issue 15, item 4).

Ray 2.60 turns token authentication on for every runtime ``ray.init`` starts and, with no token
anywhere, writes one to ``~/.ray/auth_token``. A later ``ray start --head`` finds that file and
requires the token, which ``ray job submit`` does not send unless ``RAY_AUTH_MODE=token``: the
submission failed with ``AuthenticationError ... RAY_AUTH_MODE is currently 'disabled'``.
Two fixes, both checked here: cascade's private runtime keeps its token in its own environment
(no file is left behind), and the README's steps set ``RAY_AUTH_MODE=token`` and make sure a token
exists, so they work whether or not one was left by something else.

Everything runs in subprocesses with HOME set to a fresh directory (the real ``~/.ray`` is not
touched), on loopback, and the cluster is started with ``--block`` so that stopping that one
process stops exactly this cluster (``ray stop`` would stop every Ray runtime on the machine).
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytest.importorskip("aiohttp")  # the dashboard (job API) needs ray[default]

from conftest import family_topology, write_topology  # noqa: E402
from proc_util import stop, wait_for_job_agent  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PROMPTS = ["def fibonacci(n):\n", "class Stack:\n    def push(self, x):"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS")}
    return {**env, "HOME": str(home), "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}",
            "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)}


def _run(cmd, env, timeout=300, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def home():
    path = Path(tempfile.mkdtemp(prefix="h", dir="/tmp"))  # short: Ray's socket paths under it
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_private_runtime_token_rules(tmp_path, monkeypatch):
    """Without a cluster: when cascade's private runtime sets a token of its own."""
    from cascade.backends import ray_runtime as backend

    for var in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert backend.set_private_token()  # no token anywhere: one in the environment, no file
    token = os.environ["RAY_AUTH_TOKEN"]
    assert len(token) == 64 and not (tmp_path / ".ray").exists()
    backend.drop_private_token()
    assert "RAY_AUTH_TOKEN" not in os.environ
    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # what Ray leaves set after a local ray.init
    assert backend.set_private_token() and os.environ["RAY_AUTH_TOKEN"] != token
    backend.drop_private_token()
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # the user's choice: left to Ray
    assert not backend.set_private_token() and "RAY_AUTH_TOKEN" not in os.environ
    monkeypatch.delenv("RAY_AUTH_MODE")
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("mine")  # the user's token: Ray uses it
    assert not backend.set_private_token() and "RAY_AUTH_TOKEN" not in os.environ


@pytest.mark.slow  # 1-3 min (a private runtime, a cluster, a job); the test above covers the token rules
def test_readme_steps_after_the_local_backend(family, tmp_path, home):
    workdir = tmp_path / "job"
    workdir.mkdir()
    # backend: ray without an address: a private runtime when run directly, the cluster in a job
    data = family_topology(family, ["small", "large"], ngram=True, backend="ray",
                           policy={"name": "fixed", "params": {"lookahead": {"ngram": 3, "small": 4}}})
    for level in data["levels"]:
        level["resources"] = {"num_cpus": 0.1}
    write_topology(workdir / "t.yaml", data)
    (workdir / "in.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    env = _env(home)

    # 1. The local Ray backend, as a new user runs it first.
    script = ("import json; from cascade import Cascade\n"
              "with Cascade.from_topology('t.yaml') as c:\n"
              "    print(json.dumps([g.token_ids for g in c.generate(%r, max_new_tokens=10, temperature=0)]))"
              % PROMPTS)
    local = _run([sys.executable, "-c", script], env, cwd=workdir)
    assert local.returncode == 0, local.stderr[-3000:]
    expected = json.loads(local.stdout.strip().splitlines()[-1])
    assert not (home / ".ray" / "auth_token").exists()  # nothing left behind for `ray start` to find

    # 2. The machine the issue found: a token in ~/.ray (a plain `ray.init()` leaves one too).
    token = secrets.token_hex(32)
    (home / ".ray").mkdir()
    (home / ".ray" / "auth_token").write_text(token)

    # 3. The README's steps, with loopback addresses and this test's ports.
    readme = (ROOT / "README.md").read_text()
    steps = readme[readme.index("export RAY_AUTH_MODE=token"):]
    assert steps.index("ray get-auth-token --generate") < steps.index("ray start --head") \
        < steps.index("ray job submit")
    env_token = {**env, "RAY_AUTH_MODE": "token"}
    got = _run(["ray", "get-auth-token", "--generate"], env_token)
    assert got.returncode == 0 and got.stdout == token  # an existing token is kept
    port, dashboard = _free_port(), _free_port()
    log = (home / "head.log").open("w")
    head = subprocess.Popen(
        ["ray", "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(port),
         "--num-cpus", "2", "--include-dashboard", "true", "--dashboard-host", "127.0.0.1",
         "--dashboard-port", str(dashboard), "--disable-usage-stats", "--temp-dir", str(home / "rt")],
        env=env_token, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_for(f"http://127.0.0.1:{dashboard}/api/version", head, home / "head.log")
        wait_for_job_agent(f"http://127.0.0.1:{dashboard}", head, token)
        job_env = {"RAY_ADDRESS": f"http://127.0.0.1:{dashboard}"}
        out = tmp_path / "out" / "results.jsonl"
        submit = ["ray", "job", "submit", "--working-dir", str(workdir), "--",
                  "cascade", "run", "--backend", "ray", "-t", "t.yaml", "--prompts", "in.jsonl",
                  "--output", str(out), "--max-new-tokens", "10", "--temperature", "0"]
        # negative control: without RAY_AUTH_MODE=token the CLI sends no token (the error)
        refused = _run(submit, {**env, **job_env}, timeout=120)
        assert refused.returncode != 0 and "AuthenticationError" in refused.stdout + refused.stderr
        done = _run(submit, {**env_token, **job_env}, timeout=300)
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    finally:
        stop(head)  # --block: this process stops the processes of this cluster
        log.close()
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["token_ids"] for x in lines] == expected  # greedy: the same tokens on the cluster


def _wait_for(url: str, process: subprocess.Popen, log: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"ray start exited {process.returncode}: {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except urllib.error.HTTPError:  # 401 without a token: up all the same
            return
        except OSError:
            time.sleep(1)
    logs = sorted(log.parent.glob("rt/session_latest/logs/dashboard.*"))
    raise AssertionError(f"no dashboard at {url} within {timeout:g} s: {log.read_text()[-1500:]}\n"
                         + "\n".join(f"{p.name}: {p.read_text()[-1500:]}" for p in logs))
