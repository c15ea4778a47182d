"""The Ray backend against a real Ray runtime: one local head (loopback, 2 CPUs, 4 declared GPUs,
dashboard on for the job API) shared by the whole module.

- identical tokens to the in-process backend, greedy and seeded sampling, and what the wire carries;
- a level's actor killed for real mid-generation: it restarts and the output does not change;
- a draft level that stays down is skipped (and noted); the authority staying down is a
  WorkerError carrying the committed prefix;
- ``cascade run`` submitted as a Ray job;
- GPU placement on a node declaring 4 GPUs, and the CPU fallback without CUDA;
- a placement group the cluster cannot place: an error naming the bundles, nothing left behind.

The tests that kill actors run in file order on one shared cascade (it saves starting five
actors per test); each one is correct on its own too.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("aiohttp")  # the dashboard (job API) needs ray[default]

from cascade import Cascade  # noqa: E402
from cascade.engine import Request  # noqa: E402
from cascade.errors import WorkerError  # noqa: E402
from cascade.sampling import Sampling  # noqa: E402
from conftest import family_topology, write_topology  # noqa: E402
from head_util import HEAD_LOOKAHEAD, ray_head_topology  # noqa: E402
from proc_util import stop, wait_for_job_agent  # noqa: E402

LEVELS = ["tiny", "small", "medium", "large"]
LOOKAHEAD = {"ngram": 3, "tiny": 3, "small": 5, "medium": 7}
PROMPTS = ["def fibonacci(n):\n", "class Stack:\n    def push(self, x):"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_cli() -> str:
    beside = Path(sys.executable).parent / "ray"
    return str(beside) if beside.exists() else shutil.which("ray")


@pytest.fixture(scope="module")
def ray_cluster():
    port, dashboard = _free_port(), _free_port()
    # A throwaway cluster on loopback: no token authentication (the driver, the CLI and the job
    # drivers all inherit this environment).
    saved = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "RAY_USAGE_STATS_ENABLED": "0"}
    # --block: the head stays in this one process, and stopping it stops exactly this cluster
    # (`ray stop` would stop every Ray runtime on the machine, other tests' included).
    cmd = [_ray_cli(), "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(port),
           "--num-cpus", "2", "--num-gpus", "4", "--include-dashboard", "true",
           "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard), "--disable-usage-stats"]
    head = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:  # up once the dashboard (started last) answers
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{dashboard}/api/version", timeout=2):
                    break
            except OSError:
                assert head.poll() is None and time.monotonic() < deadline, "ray start --head did not come up"
                time.sleep(1)
        wait_for_job_agent(f"http://127.0.0.1:{dashboard}", head)  # the job test submits through it
        ray.init(address=f"127.0.0.1:{port}", log_to_driver=False)
        yield {"address": f"127.0.0.1:{port}", "dashboard": f"http://127.0.0.1:{dashboard}"}
    finally:
        ray.shutdown()
        stop(head)
        if saved is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = saved


def topology(root: Path, family: Path, name: str, levels=LEVELS, ngram=False, cpus=0.2, gpus=None, **extra):
    data = family_topology(family, levels, ngram=ngram, backend="ray",
                           policy={"name": "fixed", "params": {"lookahead": {
                               k: v for k, v in LOOKAHEAD.items() if k in levels or (ngram and k == "ngram")}}},
                           **extra)
    for level in data["levels"]:
        level["resources"] = {"num_cpus": cpus, "num_gpus": (gpus or {}).get(level["name"], 0)}
        if gpus and level.get("device"):
            level["device"] = "auto"  # follow the GPUs Ray assigns
    return write_topology(root / f"{name}.yaml", data)


@pytest.fixture(scope="module")
def topo_path(family, tmp_path_factory):
    return topology(tmp_path_factory.mktemp("ray"), family, "five", ngram=True,
                    ray={"max_restarts": 3, "call_timeout_s": 120, "ngram_in_driver": False})


@pytest.fixture(scope="module")
def local_cascade(topo_path):
    with Cascade.from_topology(topo_path, backend="local") as c:
        yield c


@pytest.fixture(scope="module")
def ray_cascade(ray_cluster, topo_path):
    with Cascade.from_topology(topo_path) as c:  # the file says backend: ray
        yield c


def test_identical_tokens_and_wire_cost(ray_cascade, local_cascade):
    assert {type(w).__name__ for w in ray_cascade.workers.values()} == {"RayWorker"}  # ngram too, here
    vocab = ray_cascade.workers["large"].vocab_size
    ray_cascade.backend.reset_wire_stats()
    greedy = ray_cascade.generate(PROMPTS, max_new_tokens=24, temperature=0.0)
    assert [g.token_ids for g in greedy] == [
        g.token_ids for g in local_cascade.generate(PROMPTS, max_new_tokens=24, temperature=0.0)]
    assert all(len(g.token_ids) == 24 for g in greedy)
    wire = ray_cascade.backend.wire_stats()
    tokens = sum(len(g.token_ids) for g in greedy)
    # Greedy rows travel as one (index, value) pair, not vocab floats: what came back is a
    # small fraction of the dense rows, and less than one dense row per committed token.
    assert wire.received < wire.rows_dense / 20
    assert wire.received / tokens < vocab * 8
    assert wire.resyncs == 0

    kwargs = dict(max_new_tokens=24, temperature=0.9, top_p=0.95, seed=5)
    sampled = ray_cascade.generate(PROMPTS, **kwargs)
    assert [g.token_ids for g in sampled] == [g.token_ids for g in local_cascade.generate(PROMPTS, **kwargs)]
    # both prompts in flight at once: every remote call carries two sequences
    batched = ray_cascade.generate(PROMPTS, batch_size=2, **kwargs)
    assert [g.token_ids for g in batched] == [g.token_ids for g in sampled]
    assert sampled[0].token_ids != greedy[0].token_ids
    # the drafts took part over Ray as in-process
    assert all(e.proposed > 0 for e in sampled[0].stats.edges.values() if not e.proposed == 0) and \
        sampled[0].stats.edges["medium->large"].proposed > 0


def test_trees_under_ray_give_the_same_tokens(ray_cascade, local_cascade):
    """A tree drafted by an actor and verified by another, each in one remote call per tree
    (RayWorker.draft_tree, score_tree_probs): the same tokens as in-process, greedy and seeded,
    and greedy is plain decoding by the authority."""
    from policies.fixed import FixedPolicy

    plain = local_cascade.generate(PROMPTS, max_new_tokens=16, temperature=0.0, policy=FixedPolicy(path=["large"]))
    policy = FixedPolicy(lookahead=LOOKAHEAD, path=["tiny", "small", "medium", "large"], tree={"tiny": [2, 2, 1]})
    for kwargs in (dict(temperature=0.0), dict(temperature=0.9, seed=3, coupling="residual")):
        ray_cascade.backend.reset_wire_stats()
        remote = ray_cascade.generate(PROMPTS, max_new_tokens=16, policy=policy, **kwargs)
        local = local_cascade.generate(PROMPTS, max_new_tokens=16, policy=policy, **kwargs)
        assert [g.token_ids for g in remote] == [g.token_ids for g in local]
        if kwargs["temperature"] == 0.0:
            assert [g.token_ids for g in remote] == [g.token_ids for g in plain]
        edges = [g.stats.edges["tiny->small"] for g in remote]
        assert all(e.tree_nodes > 0 for e in edges)
        # One draft_tree call per non-empty tree (path by path: 1 + 2 + 4 score calls for
        # [2, 2, 1]); the verifier one score_tree_probs per tree round (path by path: 4 calls
        # per tree), and its empty-tree rounds (the block's last token) are at most one per block
        # it proposed to medium.
        trees = sum(e.blocks for e in edges)
        assert ray_cascade.workers["tiny"].wire.calls == trees
        small_blocks = sum(g.stats.edges["small->medium"].blocks for g in remote)
        assert trees <= ray_cascade.workers["small"].wire.calls <= trees + small_blocks
        assert ray_cascade.workers["small"].wire.resyncs == 0


def test_a_two_level_tree_under_ray_is_one_call_per_pass(ray_cluster, family, tmp_path, local_cascade):
    """small drafts [2, 2] trees for the authority: every step is one tree round, so each actor
    is called once per step (path by path over the wire: 3 calls to grow, 4 to score each tree)."""
    from policies.fixed import FixedPolicy

    path = topology(tmp_path, family, "tree", levels=["small", "large"], cpus=0.1)
    def policy():  # a policy object serves one topology
        return FixedPolicy(path=["small", "large"], tree={"small": [2, 2]})

    expected = local_cascade.generate(PROMPTS, max_new_tokens=16, temperature=0.0, policy=FixedPolicy(path=["large"]))
    with Cascade.from_topology(path, backend="local") as c:
        local = c.generate(PROMPTS, max_new_tokens=16, temperature=0.0, policy=policy())
    with Cascade.from_topology(path) as c:
        assert type(c.workers["large"]).__name__ == "RayWorker"
        c.backend.reset_wire_stats()
        remote = c.generate(PROMPTS, max_new_tokens=16, temperature=0.0, policy=policy())
        wire = {name: c.workers[name].wire for name in ("small", "large")}
    assert [g.token_ids for g in remote] == [g.token_ids for g in local] == [g.token_ids for g in expected]
    steps = sum(g.stats.steps for g in remote)
    trees = sum(g.stats.edges["small->large"].blocks for g in remote)
    assert trees > 0 and sum(g.stats.edges["small->large"].tree_nodes for g in remote) > trees
    assert wire["large"].calls == steps
    assert wire["small"].calls == trees <= steps


def test_keyed_sampling_gives_the_same_tokens_under_ray(ray_cascade, local_cascade):
    """coupling="gumbel": the position keys travel in the uniforms' place and the coupling in the
    sampling tuple, so actors draw the same noise: the same tokens as in-process for each seed."""
    kwargs = dict(max_new_tokens=16, temperature=0.8, top_p=0.95, seed=21, coupling="gumbel")
    assert [g.token_ids for g in ray_cascade.generate(PROMPTS, **kwargs)] == \
        [g.token_ids for g in local_cascade.generate(PROMPTS, **kwargs)]


def test_bad_input_is_named_under_ray(ray_cascade, family, tmp_path):
    """Token ids outside the vocabulary are a RequestError before any actor is called (was a
    RayTaskError), and a corrupt model file read in an actor is a TopologyError naming the level
    (was a WorkerError)."""
    from cascade.backends.ray import RayBackend
    from cascade.errors import RequestError, TopologyError
    from cascade.topology import load_topology

    vocab = ray_cascade.workers["large"].vocab_size
    for ids, index in (([vocab], 0), ([5, -1], 1)):
        with pytest.raises(RequestError, match=rf"^prompts\[{index}\]: token id out of the vocabulary"):
            ray_cascade.generate(ids, max_new_tokens=4)
    shutil.copytree(family / "large", tmp_path / "large")
    data = (tmp_path / "large" / "model.safetensors").read_bytes()
    (tmp_path / "large" / "model.safetensors").write_bytes(data[: len(data) // 2])
    path = topology(tmp_path, tmp_path, "broken", levels=["large"], cpus=0.1)
    with pytest.raises(TopologyError, match=r"levels\[0\]\.model: model\.safetensors: truncated"):
        RayBackend.start(load_topology(path, check_models=False))  # what validate checks, skipped


def test_killed_actors_restart_and_output_is_unchanged(ray_cascade, local_cascade):
    expected = local_cascade.generate(PROMPTS[0], max_new_tokens=32, temperature=0.0).token_ids
    engine = ray_cascade.engine
    ids = ray_cascade.tokenizer.encode(PROMPTS[0])
    before = ray_cascade.backend.info()
    state = engine.start(Request(ids, 32, Sampling(temperature=0.0)))
    for step, _ in enumerate(engine.run(state)):
        if step == 0:  # killed from outside; Ray restarts it
            ray.kill(ray_cascade.backend.actors["small"], no_restart=False)
        if step == 2:  # the authority's process exits by itself (only the original process)
            ray_cascade.backend.actors["large"].__ray_call__.remote(
                lambda self, pid: os._exit(1) if os.getpid() == pid else None, before["large"]["pid"])
    assert state.generated == expected
    assert state.stats.notes == []
    after = ray_cascade.backend.info()
    assert after["small"]["pid"] != before["small"]["pid"]
    assert after["large"]["pid"] != before["large"]["pid"]
    assert after["medium"]["pid"] == before["medium"]["pid"]
    # the restarted actors asked for the whole sequence once and rebuilt their caches from it
    assert ray_cascade.workers["small"].wire.resyncs >= 1 and ray_cascade.workers["large"].wire.resyncs >= 1


def test_draft_level_down_is_skipped(ray_cascade, local_cascade):
    ray.kill(ray_cascade.backend.actors["tiny"], no_restart=True)
    g = ray_cascade.generate(PROMPTS[1], max_new_tokens=24, temperature=0.0)
    assert g.token_ids == local_cascade.generate(PROMPTS[1], max_new_tokens=24, temperature=0.0).token_ids
    assert any("'tiny'" in n and "continuing without it" in n for n in g.stats.notes)
    assert "tiny->small" not in g.stats.edges or g.stats.edges["tiny->small"].blocks == 0
    assert g.stats.edges["small->medium"].proposed > 0  # the rest of the hierarchy still drafts


def test_authority_down_raises_with_committed_text(ray_cascade, local_cascade):
    expected = local_cascade.generate(PROMPTS[0], max_new_tokens=32, temperature=0.0).token_ids
    engine = ray_cascade.engine
    state = engine.start(Request(ray_cascade.tokenizer.encode(PROMPTS[0]), 32, Sampling(temperature=0.0)))
    with pytest.raises(WorkerError) as info:
        for step, _ in enumerate(engine.run(state)):
            if step == 1:
                ray.kill(ray_cascade.backend.actors["large"], no_restart=True)
    assert info.value.level == "large" and "not restarted" in str(info.value)
    assert 0 < len(info.value.partial) < 32 and info.value.partial == expected[: len(info.value.partial)]
    # through the API the partial result is a Generation (text included)
    with pytest.raises(WorkerError) as info:
        ray_cascade.generate(PROMPTS[0], max_new_tokens=8, temperature=0.0)
    assert info.value.partial.finish_reason == "error" and info.value.partial.text == ""


def test_authority_unresponsive_past_the_timeout(ray_cluster, family, tmp_path, local_cascade):
    import signal

    path = topology(tmp_path, family, "alone", levels=["large"], cpus=0.1, ray={"call_timeout_s": 3})
    expected = local_cascade.generate(PROMPTS[1], max_new_tokens=16, temperature=0.0).token_ids
    with Cascade.from_topology(path) as c:
        pid = c.backend.info()["large"]["pid"]
        state = c.engine.start(Request(c.tokenizer.encode(PROMPTS[1]), 16, Sampling(temperature=0.0)))
        try:
            with pytest.raises(WorkerError) as info:
                for step, _ in enumerate(c.engine.run(state)):
                    if step == 2:  # alive but frozen: no death for Ray to notice, only silence
                        os.kill(pid, signal.SIGSTOP)
        finally:
            os.kill(pid, signal.SIGCONT)
    assert info.value.level == "large" and "no answer" in str(info.value) and "3 s" in str(info.value)
    assert info.value.partial == expected[:3]  # one token per step without drafts


def test_cascade_run_as_a_ray_job(ray_cluster, family, tmp_path, local_cascade):
    from ray.job_submission import JobStatus, JobSubmissionClient

    workdir = tmp_path / "job"
    workdir.mkdir()
    # ngram (by default) and small (ray.in_driver) run in the job's driver, large in an actor
    topology(workdir, family, "t", levels=["small", "large"], ngram=True, cpus=0.1, ray={"in_driver": ["small"]})
    (workdir / "in.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = tmp_path / "out" / "results.jsonl"
    client = JobSubmissionClient(ray_cluster["dashboard"])
    job = client.submit_job(
        entrypoint=f"cascade run --topology t.yaml --prompts in.jsonl --output {out} "
                   "--max-new-tokens 12 --temperature 0",
        runtime_env={"working_dir": str(workdir)},
    )
    deadline = time.monotonic() + 240
    while not (status := client.get_job_status(job)).is_terminal() and time.monotonic() < deadline:
        time.sleep(1)
    assert status == JobStatus.SUCCEEDED, client.get_job_logs(job)[-3000:]
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["prompt"] for x in lines] == PROMPTS
    # greedy output is the authority's, whatever the hierarchy and wherever it runs
    assert [x["token_ids"] for x in lines] == [
        g.token_ids for g in local_cascade.generate(PROMPTS, max_new_tokens=12, temperature=0.0)]
    assert all(x["stats"]["new_tokens"] == 12 and x["finish_reason"] == "length" for x in lines)


def test_gpu_placement_and_cpu_fallback(ray_cluster, family, tmp_path, local_cascade):
    from ray.util import placement_group_table
    from ray.util.state import list_actors

    path = topology(tmp_path, family, "gpus", cpus=0.1,
                    gpus={"tiny": 0.5, "small": 0.5, "medium": 1, "large": 2},
                    ray={"placement_strategy": "PACK"})
    with Cascade.from_topology(path) as c:
        info = c.backend.info()
        pg_id = c.backend.placement_group.id.hex()
        names = [f"{a._ray_actor_id.hex()}" for a in c.backend.actors.values()]
        g = c.generate(PROMPTS[0], max_new_tokens=8, temperature=0.0)
    ids = {name: info[name]["gpu_ids"] for name in LEVELS}
    assert len(ids["tiny"]) == len(ids["small"]) == len(ids["medium"]) == 1 and len(ids["large"]) == 2
    assert ids["tiny"] == ids["small"]  # the two halves share one GPU
    assert len({*ids["tiny"], *ids["medium"], *ids["large"]}) == 4  # the rest are all distinct
    for name in LEVELS:
        assert info[name]["cuda_visible_devices"] == ",".join(ids[name])
        assert info[name]["device"] == "cpu" and "CUDA is not available" in info[name]["device_note"]
    assert g.token_ids == local_cascade.generate(PROMPTS[0], max_new_tokens=8, temperature=0.0).token_ids
    # close() left nothing behind
    assert placement_group_table()[pg_id]["state"] == "REMOVED"
    deadline = time.monotonic() + 30
    while (alive := [a.actor_id for a in list_actors(filters=[("state", "=", "ALIVE")])
                     if a.actor_id in names]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert alive == []


def test_an_unplaceable_group_is_a_named_error_and_leaves_nothing(ray_cluster, family, tmp_path):
    from ray.util import placement_group_table
    from ray.util.state import list_actors

    from cascade.errors import TopologyError

    data = family_topology(family, ["small", "large"], backend="ray", ray={"placement_timeout_s": 2})
    data["levels"][1]["resources"] = {"num_cpus": 0.1, "custom": {"nowhere": 1}}  # no node has it
    path = write_topology(tmp_path / "t.yaml", data)
    groups = set(placement_group_table())

    def cascade_actors() -> set[str]:
        return {a.name for a in list_actors(filters=[("state", "=", "ALIVE")]) if (a.name or "").startswith("cascade-")}

    actors = cascade_actors()
    started = time.monotonic()
    with pytest.raises(TopologyError) as info:
        Cascade.from_topology(path)
    assert time.monotonic() - started < 60  # the timeout, not a hang
    message = str(info.value)
    assert message.startswith(f"{path}: levels[*].resources: the cluster cannot place the bundles ")
    assert "{'CPU': 0.1, 'nowhere': 1.0}" in message and "within 2 s (ray.placement_timeout_s)" in message
    assert "the cluster has {'CPU': 2.0, 'GPU': 4.0}" in message and "no node has nowhere" in message
    new = {pg: placement_group_table()[pg]["state"] for pg in set(placement_group_table()) - groups}
    assert len(new) == 1 and set(new.values()) == {"REMOVED"}, new
    assert cascade_actors() <= actors


# -- feature heads: in the actor of the level they read ------------------------------------------

@pytest.fixture(scope="module")
def head_topo(tmp_path_factory, tokenizer):
    """tests/head_util.py's heads topology under Ray: ``auth`` and its ``head`` in an actor."""
    return ray_head_topology(tmp_path_factory.mktemp("ray-heads"), tokenizer)


@pytest.fixture(scope="module")
def head_cascades(ray_cluster, head_topo):
    with Cascade.from_topology(head_topo, backend="local") as local, Cascade.from_topology(head_topo) as remote:
        yield local, remote


def _held_by_actor(c, actor: str):
    """What the actor of ``actor`` holds now: each of its workers' cached sequences and its
    kept features (after the calls sent before: an actor runs them in order)."""
    return ray.get(c.backend.actors[actor].__ray_call__.remote(
        lambda self: ({name: w.cached_sequences() for name, w in self.workers.items()},
                      dict(self.worker._features.seqs))))


def test_feature_heads_under_ray_give_the_local_tokens(head_cascades, head_topo, tokenizer):
    """A head lives in its source's actor (no actor or bundle of its own), or in the driver
    beside a source there: greedy output equals plain decoding and the in-process backend's on
    head -> auth, head -> tiny -> auth (the remote head drafting for a level in the driver) and
    thead -> tiny -> auth (a head reading the middle level, in the driver), batched, and with a
    tree of the remote head's; sampled output equals the in-process backend's."""
    from cascade.backends.ray import RayHeadWorker, level_bundles
    from cascade.topology import load_topology
    from hf_util import prompts_from_text, reference_greedy
    from policies.fixed import FixedPolicy
    from workers.head import HeadWorker

    local, remote = head_cascades
    assert set(remote.backend.actors) == {"auth"} and len(level_bundles(load_topology(head_topo))) == 1
    assert isinstance(remote.workers["head"], RayHeadWorker) and isinstance(remote.workers["thead"], HeadWorker)
    info = remote.backend.info()
    assert info["head"]["pid"] == info["auth"]["pid"] and info["head"]["actor_of"] == "auth"
    assert info["head"]["can_score"] is False and set(info) == {"auth", "head"}
    prompts = prompts_from_text(tokenizer, 2)
    auth_dir = Path(head_topo).parent / "auth"
    want = [reference_greedy(auth_dir, p, 24) for p in prompts]
    for path in (["head", "auth"], ["head", "tiny", "auth"], ["thead", "tiny", "auth"]):
        policy = FixedPolicy(lookahead=HEAD_LOOKAHEAD, path=path)
        got = remote.generate(prompts, max_new_tokens=24, temperature=0.0, policy=policy, batch_size=2)
        assert [g.token_ids for g in got] == want, path
        assert [g.token_ids for g in local.generate(prompts, max_new_tokens=24, temperature=0.0, policy=policy,
                                                    batch_size=2)] == want, path
        assert got[0].stats.edges[f"{path[0]}->{path[1]}"].proposed > 0
    # the remote head grows a tree in its actor (one call), the authority scores it there
    policy = FixedPolicy(lookahead=HEAD_LOOKAHEAD, path=["head", "auth"], tree={"head": [2, 2, 1]})
    got = remote.generate(prompts, max_new_tokens=24, temperature=0.0, policy=policy, batch_size=2)
    assert [g.token_ids for g in got] == want and got[0].stats.edges["head->auth"].tree_nodes > 0
    assert info["head"]["drafts_trees"] is True
    sampled = dict(max_new_tokens=24, temperature=0.9, seed=5, policy=policy)
    assert [g.token_ids for g in remote.generate(prompts, **sampled)] == \
        [g.token_ids for g in local.generate(prompts, **sampled)]
    policy = FixedPolicy(lookahead=HEAD_LOOKAHEAD, path=["head", "tiny", "auth"])
    kwargs = dict(max_new_tokens=24, temperature=0.9, seed=4, policy=policy)
    assert [g.token_ids for g in remote.generate(prompts, **kwargs)] == \
        [g.token_ids for g in local.generate(prompts, **kwargs)]
    # released: no head entries, no kept features, no cache left in the actor, nor in the driver
    cached, features = _held_by_actor(remote, "auth")
    assert cached == {"auth": 0, "head": 0} and features == {}
    assert remote.workers["thead"].cached_sequences() == 0 and remote.workers["tiny"]._features.seqs == {}


def test_a_head_step_is_one_hand_off_call_and_one_draft_call(head_cascades, head_topo, tokenizer):
    """Per head step the head's proxy makes two remote calls: the hand-off (its new tokens out,
    the indices of the sequences the source was asked for back: no feature on the wire) and the
    draft, which sends no token (the hand-off just did); the authority one."""
    from hf_util import prompts_from_text, reference_greedy

    local, remote = head_cascades
    head, auth = remote.workers["head"], remote.workers["auth"]
    calls = []
    real_call = type(head)._call

    def recording(self, method, seq_ids, keeps, suffixes, *args):
        out = real_call(self, method, seq_ids, keeps, suffixes, *args)
        calls.append((method, [len(x) for x in suffixes], out if method == "hand_features" else None))
        return out

    prompt = prompts_from_text(tokenizer, 3)[2]
    remote.backend.reset_wire_stats()
    head._call = recording.__get__(head)
    try:
        g = remote.generate(prompt, max_new_tokens=32, temperature=0.0)  # the topology's path: head -> auth
    finally:
        del head._call
    assert g.token_ids == reference_greedy(Path(head_topo).parent / "auth", prompt, 32)
    edge = g.stats.edges["head->auth"]
    assert 0 < edge.accepted < edge.proposed  # partly rejected blocks: the hand-off had work to do
    blocks = edge.blocks
    assert [m for m, _, _ in calls] == ["hand_features", "draft"] * blocks
    assert head.wire.calls == 2 * blocks and auth.wire.calls == g.stats.steps and head.wire.resyncs == 0
    hand_offs = [(n, out) for m, n, out in calls if m == "hand_features"]
    assert hand_offs[0] == ([len(prompt)], [0])  # the prompt once; its features computed in the actor
    # then only the tokens committed since (at most a block and the bonus token), and the draft none
    assert all(n[0] <= HEAD_LOOKAHEAD["head"] + 1 for n, _ in hand_offs[1:])
    assert all(n == [0] for m, n, _ in calls if m == "draft")
    assert all(out in ([], [0]) for _, out in hand_offs)
    # what came back to the head: its draft rows (greedy: one pair each) and a few ints, no features
    assert head.wire.received < 64 * (edge.proposed + 2 * blocks)


def test_a_killed_actor_rebuilds_its_head(head_cascades, head_topo, tokenizer):
    """The authority's actor (which hosts the head) killed mid-generation: Ray restarts it, the
    head and the authority each resend their sequences once, the source recomputes the features
    the fresh head lacks, and the output does not change."""
    from hf_util import prompts_from_text, reference_greedy

    local, remote = head_cascades
    prompt = prompts_from_text(tokenizer, 1)[0]
    before = remote.backend.info()["auth"]["pid"]
    remote.backend.reset_wire_stats()
    state = remote.engine.start(Request(prompt, 32, Sampling(temperature=0.0)))
    held = []
    for step, _ in enumerate(remote.engine.run(state)):
        if step == 1:
            ray.kill(remote.backend.actors["auth"], no_restart=False)
            # ray.kill takes effect asynchronously: had the next step's first call (the hand-off)
            # still reached the old actor and only its draft the fresh one, the fresh head would
            # draft from its own predicted features for one step (exact, but not what is tested).
            deadline = time.monotonic() + 60
            while remote.backend.info()["auth"]["pid"] == before:
                assert time.monotonic() < deadline, "the killed actor did not restart within 60 s"
                time.sleep(0.05)
        if step == 2:  # the fresh head's entries: real features of the prompt and on, from the source
            held = ray.get(remote.backend.actors["auth"].__ray_call__.remote(
                lambda self, seq: (list(self.workers["head"]._seqs[seq].tokens), self.workers["head"]._seqs[seq].real),
                state.seq_id))
            sequence = prompt + state.generated
    tokens, real = held
    assert real > len(prompt) and tokens[:real] == sequence[:real]
    assert state.generated == reference_greedy(Path(head_topo).parent / "auth", prompt, 32)
    assert state.stats.notes == [] and state.stats.edges["head->auth"].proposed > 0
    assert remote.backend.info()["head"]["pid"] != before
    assert remote.workers["head"].wire.resyncs >= 1 and remote.workers["auth"].wire.resyncs >= 1

