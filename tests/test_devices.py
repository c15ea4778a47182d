"""One device rule (workers/devices.py): workers fall back from an unavailable CUDA device with a
warning, training refuses one, and an unknown name is a ValueError that names it."""
from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch")

from workers.devices import resolve_device  # noqa: E402

NO_CUDA = not torch.cuda.is_available()


def test_auto_and_cpu():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("name", ["gpu", "cuda:x", "tpu0", ""])
def test_unknown_name_is_a_value_error_naming_it(name):
    for fallback in (True, False):
        with pytest.raises(ValueError, match=f"unknown device {name!r}"):
            resolve_device(name, fallback=fallback)


@pytest.mark.skipif(not NO_CUDA, reason="needs a machine without CUDA")
def test_unavailable_cuda_falls_back_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="workers.devices"):
        assert resolve_device("cuda:1") == torch.device("cpu")
    assert "cuda:1" in caplog.text and "falling back to CPU" in caplog.text


@pytest.mark.skipif(not NO_CUDA, reason="needs a machine without CUDA")
def test_unavailable_cuda_is_an_error_without_fallback():
    with pytest.raises(ValueError, match="'cuda' requested but it is not available"):
        resolve_device("cuda", fallback=False)


def test_a_device_index_past_the_last_is_unavailable():
    past = f"cuda:{torch.cuda.device_count()}"
    assert resolve_device(past) == torch.device("cpu")
    with pytest.raises(ValueError, match="not available"):
        resolve_device(past, fallback=False)


def test_fastest_dtype_is_bf16_only_where_the_cpu_computes_it(monkeypatch, tmp_path):
    import builtins

    from workers import devices

    cpu = torch.device("cpu")
    real_open = builtins.open
    for flags, want in (("fpu avx2 fma", torch.float32), ("avx512f avx512_bf16", torch.bfloat16),
                        ("amx_bf16 amx_tile", torch.bfloat16)):
        info = tmp_path / "cpuinfo"
        info.write_text(f"flags\t\t: {flags}\n")
        monkeypatch.setattr(builtins, "open", lambda path, *a, **k: real_open(info if path == "/proc/cpuinfo" else path, *a, **k))
        assert devices.resolve_dtype("fastest", cpu) == want, flags
    monkeypatch.setattr(builtins, "open", real_open)
    assert devices.resolve_dtype("auto", cpu) == "auto"
    assert devices.resolve_dtype("float64", cpu) == torch.float64


def test_a_topology_level_may_ask_for_the_fastest_dtype(family, tmp_path):
    from cascade import Cascade
    from conftest import family_topology, write_topology
    from workers.devices import native_bf16

    data = family_topology(family, ["large"])
    data["levels"][0]["dtype"] = "fastest"
    with Cascade.from_topology(write_topology(tmp_path / "t.yaml", data)) as c:
        dtype = next(c.workers["large"].model.parameters()).dtype
    assert dtype == (torch.bfloat16 if native_bf16(torch.device("cpu")) else torch.float32)
