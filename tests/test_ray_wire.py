"""The Ray backend's pure parts, no cluster needed: the wire format is lossless, bundles are
planned from the topology, and the ``ray:`` section is validated field by field."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cascade.errors import TopologyError
from cascade.backends.ray import plan_bundles
from cascade.backends.wire import dense_nbytes, pack_rows, packed_nbytes, unpack_rows
from cascade.topology import load_topology, topology_from_dict

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("rows", [
    torch.nn.functional.one_hot(torch.tensor([3, 7, 1]), 320).double(),  # greedy rows
    torch.softmax(torch.randn(4, 320, generator=torch.Generator().manual_seed(0)), -1),  # sampling rows
    torch.softmax(torch.randn(2, 320, dtype=torch.float64), -1).masked_fill(torch.rand(2, 320) < 0.9, 0.0),  # top-k
    torch.randn(3, 50).bfloat16(),  # raw bfloat16 logits
    torch.randn(2, 64).half(),
    torch.zeros(0, 320),  # an empty draft
], ids=["one-hot", "dense", "sparse", "bfloat16", "float16", "empty"])
def test_pack_unpack_is_exact(rows):
    packed = pack_rows(rows)
    back = unpack_rows(packed)
    assert back.dtype == rows.dtype and back.shape == rows.shape
    assert torch.equal(back, rows)  # bit for bit: no rounding on the wire
    assert dense_nbytes(packed) == rows.numel() * rows.element_size()


def test_greedy_rows_travel_as_one_entry_each():
    rows = torch.nn.functional.one_hot(torch.tensor([5, 9, 2, 2]), 4096).float()
    packed = pack_rows(rows)
    assert packed[0] == "sparse"
    assert packed_nbytes(packed) == 4 * (4 + 4 + 4) + 16  # row, column, value per row
    assert pack_rows(torch.softmax(torch.randn(4, 4096), -1))[0] == "dense"  # sparse would be larger


def test_bundles_of_the_4gpu_topology():
    topo = load_topology(ROOT / "topologies" / "ray-4gpu.yaml", check_models=False)
    models = [lv for lv in topo.spec.levels if lv.kind != "ngram"]  # ngram runs in the driver
    bundles, index = plan_bundles(models)
    by_level = {lv.name: bundles[i] for lv, i in zip(models, index)}
    assert index[0] == index[1]  # tiny and small share a bundle...
    assert by_level["tiny"] == {"GPU": 1.0, "CPU": 2.0}  # ...of one GPU
    assert by_level["medium"] == {"CPU": 1.0, "GPU": 1.0}
    assert by_level["large"] == {"CPU": 2.0, "GPU": 2.0}
    assert len(bundles) == 3


def test_fractional_gpus_open_a_new_bundle_when_full():
    levels = topology_from_dict({"levels": [
        {"name": n, "kind": "ngram" if n == "a" else "hf", "model": None if n == "a" else "org/m",
         "resources": {"num_cpus": 0, "num_gpus": g, "custom": {"accel": 1} if n == "d" else {}}}
        for n, g in [("a", 0.0), ("b", 0.6), ("c", 0.6), ("d", 0.3)]
    ] + [{"name": "z", "model": "org/m"}]}, check_models=False).spec.levels
    bundles, index = plan_bundles(levels)
    assert index[1] != index[2] and index[3] == index[1]  # 0.6 + 0.6 > 1; 0.6 + 0.3 fits
    assert bundles[index[3]] == {"GPU": 1.0, "accel": 1}
    assert bundles[index[0]] == {"CPU": 0.01}  # Ray rejects an empty bundle


@pytest.mark.parametrize("ray_section, field", [
    ({"address": "http://example.com"}, "ray.address"),
    ({"placement_strategy": "SCATTER"}, "ray.placement_strategy"),
    ({"max_restarts": -1}, "ray.max_restarts"),
    ({"call_timeout_s": 0}, "ray.call_timeout_s"),
    ({"placement_timeout_s": -5}, "ray.placement_timeout_s"),
    ({"start_timeout_s": 0}, "ray.start_timeout_s"),
    ({"ngram_in_driver": "sometimes"}, "ray.ngram_in_driver"),
    ({"in_driver": ["nope"]}, "ray.in_driver[0]"),
    ({"adress": "auto"}, "ray.adress"),
])
def test_ray_section_errors_name_the_field(ray_section, field):
    with pytest.raises(TopologyError) as info:
        topology_from_dict({"levels": [{"name": "m", "model": "org/m"}], "backend": "ray", "ray": ray_section},
                           check_models=False)
    assert f"<spec>: {field}:" in str(info.value)


def test_ray_section_accepts_addresses():
    for address in ("auto", "local", "127.0.0.1:6379", "ray://head.example:10001"):
        topo = topology_from_dict({"levels": [{"name": "m", "model": "org/m"}], "ray": {"address": address}},
                                  check_models=False)
        assert topo.spec.ray.address == address
