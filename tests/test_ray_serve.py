"""``cascade serve --backend ray``: the FastAPI app on Ray Serve, each replica a cascade whose
levels are Ray actors. One real run on a local Ray cluster this test starts on loopback (its head
held by one ``ray start --block`` process, stopped at the end: nothing else on the machine is
touched), and the deployment's shape and the ``serve:`` section without a cluster."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")

from cascade.errors import TopologyError  # noqa: E402
from cascade.serve import ray_serve  # noqa: E402
from cascade.topology import load_topology  # noqa: E402
from conftest import family_topology, write_topology  # noqa: E402
from hf_util import reference_greedy  # noqa: E402
from proc_util import stop  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
_MAIN = "import sys; from cascade.cli import main; sys.exit(main())"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _topology(root: Path, family: Path, **serve) -> Path:
    data = family_topology(family, ["small", "large"], ngram=True, name="served", backend="ray",
                           policy={"name": "fixed", "params": {"lookahead": {"ngram": 3, "small": 4}}},
                           serve=serve)
    for level in data["levels"]:
        level["resources"] = {"num_cpus": 0.1}
    return write_topology(root / "t.yaml", data)


def test_serve_section_and_deployment_shape(family, tmp_path):
    path = _topology(tmp_path, family, replicas=2, max_ongoing_requests=3, num_cpus=0.5)
    spec = load_topology(path).spec.serve
    assert (spec.replicas, spec.max_ongoing_requests, spec.num_cpus) == (2, 3, 0.5)
    for bad, field in [({"replicas": 0}, "serve.replicas"), ({"max_ongoing_requests": 0}, "serve.max_ongoing_requests"),
                       ({"replica": 2}, "serve.replica")]:
        with pytest.raises(TopologyError, match=field):
            load_topology(_topology(tmp_path, family, **bad))
    app = ray_serve.application(ray_serve.ReplicaOptions(str(path)), spec.replicas, spec.max_ongoing_requests,
                                spec.num_cpus)  # built without a cluster
    deployment = app._bound_deployment
    assert deployment.num_replicas == 2 and deployment.max_ongoing_requests == 3
    assert deployment.ray_actor_options["num_cpus"] == 0.5
    assert hasattr(deployment.func_or_class, "__serve_build_asgi_app__")  # the late-bound ingress


@pytest.mark.slow  # 2-4 min here (a cluster, Ray Serve, two replicas' actors); the test above covers the shape
def test_greedy_completion_through_ray_serve(family, tokenizer, tmp_path):
    import openai

    path = _topology(tmp_path, family, replicas=2, max_ongoing_requests=4, num_cpus=0.2)
    port, http = _free_port(), _free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled",  # a throwaway cluster on loopback
           "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1",
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("RAY_ADDRESS", None)
    head_log, serve_log = (tmp_path / "head.log").open("w"), (tmp_path / "serve.log").open("w")
    head = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(port),
         "--num-cpus", "4", "--include-dashboard", "false", "--disable-usage-stats"],
        env=env, stdout=head_log, stderr=subprocess.STDOUT)
    served = None
    try:
        _wait(lambda: "Ray runtime started" in (tmp_path / "head.log").read_text(), head, tmp_path / "head.log")
        served = subprocess.Popen(
            [sys.executable, "-c", _MAIN, "serve", "--backend", "ray", "--address", f"127.0.0.1:{port}",
             "-t", str(path), "--port", str(http), "--max-num-seqs", "4"],
            env=env, cwd=ROOT, stdout=serve_log, stderr=subprocess.STDOUT)
        _wait(lambda: _status(f"http://127.0.0.1:{http}/health") == 200, served, tmp_path / "serve.log", 400)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="unused", max_retries=0,
                               timeout=120)
        assert [m.id for m in client.models.list().data] == ["served"]
        for prompt in ["def fibonacci(n):\n", "class Stack:\n    def push(self, x):"]:
            ids = tokenizer.encode(prompt)
            want = reference_greedy(str(family / "large"), ids, 16)
            eos = tokenizer.eos_token_id
            want = want[: want.index(eos) + 1] if eos in want else want
            r = client.completions.create(model="served", prompt=prompt, max_tokens=16, temperature=0)
            assert r.choices[0].text == tokenizer.decode(want, skip_special_tokens=True)
            assert r.usage.completion_tokens == len(want)
        served.send_signal(signal.SIGTERM)  # deletes the application, leaves the cluster
        assert served.wait(timeout=120) == 0, (tmp_path / "serve.log").read_text()[-3000:]
    finally:
        if served is not None and served.poll() is None:
            served.kill()
            served.wait()
        stop(head)  # --block: stops exactly this cluster
        head_log.close()
        serve_log.close()


def _status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except OSError as exc:
        return getattr(exc, "code", None)


def _wait(ready, process: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if process.poll() is not None:
            raise AssertionError(f"exited {process.returncode}: {log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"not ready within {timeout:g} s: {log.read_text()[-3000:]}")
        time.sleep(1)
