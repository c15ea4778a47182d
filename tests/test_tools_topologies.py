"""Every tool runs on every bundled topology (``topologies/*.yaml``) with its defaults, at tiny
size: ``cascade bench``, ``demo``, ``ab``, ``cost-curve`` and ``bench-serve`` (against the
topology served in this process). A configuration that cannot apply to a topology is left out
with a line saying why, never a traceback. Nothing about speed is asserted.

The topologies over the pulled real model (``pulled:`` levels) are marked ``real_model`` and
``slow``; the others run in the default run. A topology whose backend is Ray (``ray-4gpu.yaml``,
one GPU or more per level) runs its levels in this process (``--backend local``): a CPU machine
holds none of the GPUs it asks for."""
from __future__ import annotations

import contextlib
import json
import threading
import time
from pathlib import Path

import pytest
import yaml

from cascade.cli import main

# independent runs, each loading its own models: any worker may take any of them
SPLIT_ACROSS_WORKERS = True
ROOT = Path(__file__).resolve().parents[1]
TOPOLOGIES = sorted((ROOT / "topologies").glob("*.yaml"))


def _spec(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _real(path: Path) -> bool:
    return any(str(lv.get("model", "")).startswith("pulled:") for lv in _spec(path)["levels"])


def _ray(path: Path) -> bool:
    return _spec(path).get("backend") == "ray"


def _param(path: Path):
    marks = [pytest.mark.slow, pytest.mark.real_model] if _real(path) else []
    return pytest.param(path, id=path.stem, marks=marks)


EVERY = [_param(p) for p in TOPOLOGIES]


def test_every_bundled_topology_is_covered():
    assert {p.stem for p in TOPOLOGIES} >= {"2level", "3level", "4level", "4level-ngram", "ray-4gpu", "smollm2",
                                            "smollm2-drafters"}
    assert {"smollm2", "smollm2-drafters"} <= {p.stem for p in TOPOLOGIES if _real(p)}


def _prompts(path: Path, tmp_path: Path, n: int = 1) -> Path:
    """The first ``n`` of the prompts the topology's own demo takes: chats for the real model,
    code for the bundled family."""
    source = ROOT / "examples" / "prompts" / ("chat-heldout.jsonl" if _real(path) else "heldout.jsonl")
    out = tmp_path / "prompts.jsonl"
    out.write_text("\n".join(source.read_text().splitlines()[:n]) + "\n")
    return out


def _backend(path: Path) -> list[str]:
    return ["--backend", "local"] if _ray(path) else []


@pytest.mark.parametrize("topology", EVERY)
def test_bench(topology, tmp_path, capsys):
    out = tmp_path / "bench"
    code = main(["bench", "-t", str(topology), "--prompts", str(_prompts(topology, tmp_path)), "--max-new-tokens", "4",
                 "--out", str(out), "--no-progress"])
    captured = capsys.readouterr()
    assert code == 0, captured.out[-3000:] + captured.err[-3000:]
    data = json.loads((out / "bench.json").read_text())
    names = [r["name"] for r in data["reports"]]
    assert names[:2] == ["plain", "cascade:authority"] and len(names) > 3
    for r in data["reports"]:  # every row beside plain decoding and beside the authority alone
        assert r["speedup_median"] > 0 and r["speedup_over_authority_median"] > 0, r["name"]
    left_out = data["config"]["left_out"]
    for note in left_out:  # each said once, before the run, in a line of its own and in the report
        assert f"cascade bench: left out {note}\n" in captured.err and f"- {note}" in captured.out
    assert "Traceback" not in captured.err
    # transformers' assisted generation takes a drafter over the authority's own vocabulary only:
    # the trimmed ones (draft_vocab.json beside the weights) are left out, the others run
    models = [lv for lv in _spec(topology)["levels"] if lv.get("kind", "hf") == "hf"]
    trimmed = {lv["name"] for lv in models[:-1] if (topology.parent / lv["model"] / "draft_vocab.json").exists()}
    assert {n.split(":")[1] for n in left_out if n.startswith("hf-assisted:")} == trimmed
    assert {f"hf-assisted:{lv['name']}" for lv in models[:-1] if lv["name"] not in trimmed} <= set(names)


@pytest.mark.parametrize("topology", EVERY)
def test_demo(topology, tmp_path, capsys):
    code = main(["demo", "-t", str(topology), "--prompts", str(_prompts(topology, tmp_path)), "-n", "1",
                 "--max-new-tokens", "4", "--repeats", "1", "--quiet", *_backend(topology)])
    out = capsys.readouterr().out
    assert code == 0, out[-3000:]
    assert out.count("cascade, authority alone") == 2 and "of which drafting" in out  # greedy and sampled


@pytest.mark.parametrize("topology", EVERY)
def test_ab(topology, tmp_path, capsys):
    out = tmp_path / "ab"
    code = main(["ab", "-t", str(topology), "--a", "fixed", "--b", "auto", "--prompts",
                 str(_prompts(topology, tmp_path, 2)), "--max-new-tokens", "4", "--repeats", "1", "--warmup", "1",
                 "--out", str(out), "--no-progress", *_backend(topology)])
    stdout = capsys.readouterr().out
    assert code == 0, stdout[-3000:]
    summary = json.loads((out / "ab.json").read_text())["summary"]
    assert summary["prompts"] == 2 and summary["geomean_ratio"] > 0 and summary["exactness_failures"] == []


@pytest.mark.parametrize("topology", EVERY)
def test_cost_curve(topology, tmp_path, capsys):
    out = tmp_path / "curve.json"
    code = main(["cost-curve", "-t", str(topology), "--positions", "1,2", "--repeats", "1", "--prefix", "8",
                 "--json", str(out), *_backend(topology)])
    assert code == 0, capsys.readouterr()
    scoring = {lv["name"] for lv in _spec(topology)["levels"] if lv.get("kind", "hf") == "hf"}
    assert set(json.loads(out.read_text())["levels"]) == scoring  # every level with a forward pass of its own


@contextlib.contextmanager
def _served(topology: Path):
    """The topology served by cascade's own app on a free loopback port, in this process (its
    levels here too); yields the base URL."""
    import uvicorn

    from cascade.api import Cascade
    from cascade.serve.app import build_app
    from cascade.serve.server import Server

    server = Server(Cascade.from_topology(topology, backend="local"), max_num_seqs=2)
    try:
        server.start()
        web = uvicorn.Server(uvicorn.Config(build_app(server), host="127.0.0.1", port=0, log_level="warning"))
        thread = threading.Thread(target=web.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 60
        while not web.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        port = web.servers[0].sockets[0].getsockname()[1]
        try:
            yield f"http://127.0.0.1:{port}/v1"
        finally:
            web.should_exit = True
            thread.join(timeout=30)
    finally:
        server.close()


@pytest.mark.parametrize("topology", EVERY)
def test_bench_serve(topology, tmp_path, capsys):
    out = tmp_path / "serve.json"
    with _served(topology) as base:
        code = main(["bench-serve", "--base-url", base, "--prompts", str(_prompts(topology, tmp_path, 2)),
                     "--concurrency", "2", "--num-requests", "2", "--max-tokens", "4", "--repeats", "1",
                     "--json", str(out)])
    assert code == 0, capsys.readouterr()
    summary = json.loads(out.read_text())["summary"]
    assert (summary["requests"], summary["completed"], summary["failed"]) == (2, 2, 0)
