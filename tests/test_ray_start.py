"""Ray starts, or says why not (issue 28, items 3 and 4).

- A private runtime is sized for replicas × levels (each replica's own CPUs plus one bundle per
  level actor): counted for every bundled topology, without a cluster.
- A cluster to join that does not answer is a ClusterError within seconds naming the address
  and where it came from (the argument, the topology, RAY_ADDRESS, or the ``ray_current_cluster``
  file a killed ``ray start`` leaves behind) and what to do; Ray alone retries for minutes.
- With no address, that stale file is ignored: cascade starts its private runtime.
- What the cluster cannot place is an error naming the bundles and the cluster's resources, and
  ``cascade serve --backend ray`` / ``cascade run --backend ray`` exit 1 with it, leaving no Ray
  process behind. Before the fix the server printed its address and hung (the test times out).

Ray's temporary directory (RAY_TMPDIR) is a fresh short one per test, so that the fake stale file
and every private runtime started here stay apart from any other Ray on the machine.
"""
from __future__ import annotations

import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from cascade import Cascade  # noqa: E402
from cascade.backends.ray import level_bundles, private_cpus  # noqa: E402
from cascade.errors import ClusterError  # noqa: E402
from cascade.topology import load_topology  # noqa: E402
from conftest import family_topology, write_topology  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
_MAIN = "import sys; from cascade.cli import main; sys.exit(main())"


def _dead_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_tmp(monkeypatch):
    """A private Ray temporary directory, short (Ray's socket paths must fit 107 bytes), and no
    RAY_ADDRESS; the process must not be connected to Ray already."""
    if ray.is_initialized():
        pytest.skip("this process is connected to Ray already")
    path = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))
    monkeypatch.setenv("RAY_TMPDIR", str(path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _stale_file(tmp: Path, port: int) -> Path:
    """What `ray start --head` killed without `ray stop` leaves: a file naming a dead head."""
    (tmp / "ray").mkdir(exist_ok=True)
    file = tmp / "ray" / "ray_current_cluster"
    file.write_text(f"127.0.0.1:{port}")
    return file


def test_private_runtime_is_sized_for_replicas_and_levels(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)  # this machine: 2 cores
    for path in sorted((ROOT / "topologies").glob("*.yaml")):
        topo = load_topology(path, check_models=False)
        levels = sum(b.get("CPU", 0.0) for b in level_bundles(topo))
        serve = topo.spec.serve
        assert private_cpus(topo) == max(2, math.ceil(levels - 1e-9)), path.name
        assert private_cpus(topo, serve.replicas, serve.num_cpus) == max(
            2, math.ceil(serve.replicas * (serve.num_cpus + levels) - 1e-9)), path.name
    four = load_topology(ROOT / "topologies/4level.yaml", check_models=False)
    assert private_cpus(four) == 4  # four level actors of one CPU each
    assert private_cpus(four, 1, 1.0) == 5  # and the replica's own CPU (was: os.cpu_count() = 2)
    assert private_cpus(four, 3, 1.0) == 15


@pytest.mark.parametrize("source", ["argument", "topology", "RAY_ADDRESS", "stale file"])
def test_an_unreachable_address_names_itself_and_its_source(source, ray_tmp, family, tmp_path, monkeypatch):
    port = _dead_port()
    address = f"127.0.0.1:{port}"
    ray_section = {"address": address} if source == "topology" else {}
    path = write_topology(tmp_path / "t.yaml", family_topology(family, ["small"], backend="ray", ray=ray_section))
    given = {"argument": address, "stale file": "auto"}.get(source)
    if source == "RAY_ADDRESS":
        monkeypatch.setenv("RAY_ADDRESS", address)
    file = _stale_file(ray_tmp, port) if source == "stale file" else None
    started = time.monotonic()
    with pytest.raises(ClusterError) as info:
        Cascade.from_topology(path, address=given)
    took = time.monotonic() - started
    message = str(info.value)
    assert f"no Ray cluster answers at {address}" in message
    expected = {"argument": ("the address argument", "correct the address"),
                "topology": (f"{path}: ray.address", "correct the address"),
                "RAY_ADDRESS": ("the RAY_ADDRESS variable", "unset it"),
                "stale file": (f"the file {file}", "`ray stop` removes it")}[source]
    assert all(part in message for part in expected), message
    assert took < 60, took  # a probe of a few seconds; Ray itself retries for minutes
    assert not ray.is_initialized()


def test_no_address_starts_a_private_runtime_whatever_a_stale_file_says(ray_tmp, family, tmp_path):
    port = _dead_port()
    _stale_file(ray_tmp, port)
    data = family_topology(family, ["small"], ngram=True, backend="ray",
                           policy={"name": "fixed", "params": {"lookahead": {"ngram": 3}}})
    data["levels"][1]["resources"] = {"num_cpus": 0.5}
    path = write_topology(tmp_path / "t.yaml", data)
    with Cascade.from_topology(path, backend="local") as c:
        want = c.generate("def f(x):", max_new_tokens=6, temperature=0.0).token_ids
    with Cascade.from_topology(path) as c:  # backend ray, no address anywhere
        assert ray.is_initialized() and str(port) not in ray.get_runtime_context().gcs_address
        assert c.generate("def f(x):", max_new_tokens=6, temperature=0.0).token_ids == want
    assert not ray.is_initialized()  # the private runtime is stopped on close


def _ray_processes(tmp: Path) -> list[int]:
    """Processes whose command line names ``tmp`` (a runtime's GCS, raylet and agents do)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(tmp) in (proc / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def _cli(args: list[str], tmp: Path, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_TMPDIR": str(tmp), "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("RAY_ADDRESS", None)
    return subprocess.run([sys.executable, "-c", _MAIN, *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_an_unplaceable_cascade_fails_serve_and_run_with_the_bundles(ray_tmp, family, tmp_path):
    data = family_topology(family, ["small", "large"], name="nowhere", backend="ray",
                           ray={"placement_timeout_s": 2})
    data["levels"][1]["resources"] = {"num_cpus": 1, "custom": {"nowhere": 1}}  # no node has it
    path = write_topology(tmp_path / "t.yaml", data)
    prompts = tmp_path / "in.jsonl"
    prompts.write_text('{"prompt": "def f(x):"}\n')
    for args in (["serve", "--backend", "ray", "-t", str(path), "--port", str(_dead_port())],
                 ["run", "--backend", "ray", "-t", str(path), "--prompts", str(prompts), "-o",
                  str(tmp_path / "out.jsonl")]):
        done = _cli(args, ray_tmp, timeout=240)  # without the fix `serve` never returns
        assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-3000:]
        errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1, done.stderr[-3000:]
        error = errors[0]
        assert error.startswith(f"error: {path}: ") and "cannot place the bundles" in error, error
        assert "{'CPU': 1.0, 'nowhere': 1.0}" in error and "the cluster has {'CPU':" in error, error
        assert "no node has nowhere" in error and "within 2 s (ray.placement_timeout_s)" in error, error
        if args[0] == "serve":
            assert "serve.replicas" in error and "cascade serve: starting" not in done.stdout
        deadline = time.monotonic() + 30  # the runtime's processes are gone with it
        while (left := _ray_processes(ray_tmp)) and time.monotonic() < deadline:
            time.sleep(1)
        assert left == [], left


def test_a_replica_that_fails_to_start_ends_serve_with_its_reason(ray_tmp, family, tmp_path):
    """The cluster can hold it, but the replica's constructor raises (here: its level actors are
    given no time to start): Ray Serve would retry it, the command exits 1 with the reason."""
    data = family_topology(family, ["small", "large"], name="impatient", backend="ray",
                           ray={"start_timeout_s": 0.001})
    path = write_topology(tmp_path / "t.yaml", data)
    done = _cli(["serve", "--backend", "ray", "-t", str(path), "--port", str(_dead_port())], ray_tmp, timeout=240)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert errors == ["error: cascade serve: a replica failed to start: cascade.errors.WorkerError: level 'small': "
                      "actor did not start within 0.001 s (ray.start_timeout_s)"], done.stderr[-3000:]
    assert "on Ray Serve at http://" not in done.stdout  # it never claimed to serve
    deadline = time.monotonic() + 30
    while (left := _ray_processes(ray_tmp)) and time.monotonic() < deadline:
        time.sleep(1)
    assert left == [], left


@pytest.mark.slow  # about 1 min here (a private runtime, Ray Serve, four level actors); sizing is counted above
def test_the_bundled_4level_topology_serves_on_a_private_runtime(ray_tmp):
    """What hung on a 2-core machine: a private runtime declaring os.cpu_count() CPUs could not
    hold the replica's CPU and its four level bundles, and /health never answered."""
    import signal
    import urllib.request

    port = _dead_port()
    env = {**os.environ, "RAY_TMPDIR": str(ray_tmp), "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    log = (ray_tmp / "serve.log").open("w")
    served = subprocess.Popen([sys.executable, "-c", _MAIN, "serve", "--backend", "ray", "-t",
                               "topologies/4level.yaml", "--port", str(port)],
                              env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 400
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert served.poll() is None, (ray_tmp / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (ray_tmp / "serve.log").read_text()[-3000:]
            time.sleep(2)
        served.send_signal(signal.SIGTERM)
        assert served.wait(timeout=120) == 0, (ray_tmp / "serve.log").read_text()[-3000:]
    finally:
        if served.poll() is None:
            served.kill()
            served.wait()
        log.close()
    deadline = time.monotonic() + 30
    while (left := _ray_processes(ray_tmp)) and time.monotonic() < deadline:
        time.sleep(1)
    assert left == [], left
