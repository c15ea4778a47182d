"""`cascade cost-curve`: each level's pass cost by the number of positions it scores, through
its own worker (no speed is asserted: only what is measured and reported)."""
from __future__ import annotations

import json

from cascade.cli import main
from conftest import family_topology, write_topology


def test_cost_curve_reports_each_level_by_width(family, tmp_path, capsys):
    topo = write_topology(tmp_path / "t.yaml", family_topology(family, ["tiny", "large"], ngram=True))
    out = tmp_path / "curve.json"
    assert main(["cost-curve", "-t", str(topo), "--positions", "1,3,8", "--repeats", "2", "--prefix", "20",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "torch threads: 1" in text and "large (float64), ms by new positions: 1:" in text
    data = json.loads(out.read_text())
    assert set(data["levels"]) == {"tiny", "large"}  # the n-gram level has no forward pass
    assert data["machine"]["cpu"] and "Measured " in text
    for level in data["levels"].values():
        assert set(level["ms"]) == {"1", "3", "8"}
        assert all(r["repeats"] == 2 and 0 < r["min"] <= r["median"] <= r["max"] for r in level["ms"].values())
    assert main(["cost-curve", "-t", str(topo), "--positions", "0"]) == 2
    capsys.readouterr()
    for wrong in ("ngram", "nowhere"):  # no forward pass to measure: a clear error, not a traceback
        assert main(["cost-curve", "-t", str(topo), "--levels", wrong, "--repeats", "1"]) == 2
        assert f"--levels: {wrong} has no forward pass" in capsys.readouterr().err


def test_cost_curve_measures_batched_passes(family, tmp_path, capsys):
    """--batch B: B sequences a pass, each scoring the width (a server's verification)."""
    topo = write_topology(tmp_path / "t.yaml", family_topology(family, ["tiny", "large"]))
    out = tmp_path / "curve.json"
    assert main(["cost-curve", "-t", str(topo), "--positions", "1,4", "--repeats", "2", "--prefix", "12",
                 "--batch", "3", "--levels", "large", "--json", str(out)]) == 0
    assert "large (float64), ms by new positions, 3 sequences a pass, each: 1:" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["batch"] == 3 and set(data["levels"]["large"]["ms"]) == {"1", "4"}
    assert main(["cost-curve", "-t", str(topo), "--batch", "0"]) == 2
