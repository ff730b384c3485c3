"""bench/pareto.py's bookkeeping: which points of an earlier results file a partial rerun carries, and the
hand-written notes under the table surviving a rewrite. Losing or duplicating a point, or a carried point
shown as measured, would silently corrupt the published chart."""

import json

import pytest


@pytest.fixture(scope="module")
def pareto():
    from bench import pareto

    return pareto


def _point(name: str, family: str, ppl: float, per_weight: float) -> dict:
    return {"name": name, "family": family, "ppl": ppl, "per_weight": per_weight}


def _dense(ppl: float = 28.55) -> dict:
    return _point("dense (fp32)", "dense", ppl, 4.0)


def _earlier(tmp_path, dense_ppl: float = 28.55):
    points = [_dense(dense_ppl), _point("leapctl 30% 4-bit", "leapctl", 33.0, 0.63),
              _point("leapctl 50% 4-bit", "leapctl", 46.6, 0.48),
              _point("llama.cpp Q4_0", "llama.cpp", 36.0, 0.67)]
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps({"command": "python -m bench.pareto --old", "date": "2026-12-06",
                                "points": points}))
    return path


def test_carry_keeps_the_points_this_run_did_not_measure_and_marks_them(pareto, tmp_path):
    measured = [_dense(), _point("leapctl 50% 4-bit", "leapctl", 45.0, 0.48)]
    carried = pareto.carried_points(_earlier(tmp_path), measured)
    assert [p["name"] for p in carried] == ["leapctl 30% 4-bit", "llama.cpp Q4_0"]
    assert {p["carried_from"] for p in carried} == {"`python -m bench.pareto --old` (2026-12-06)"}


def test_carry_refuses_an_earlier_file_scored_on_other_tokens(pareto, tmp_path):
    measured = [_dense()]
    with pytest.raises(SystemExit, match="dense perplexity 28.9000 is not this run's 28.5500"):
        pareto.carried_points(_earlier(tmp_path, dense_ppl=28.9), measured)


def test_a_rewrite_keeps_the_notes_under_the_table_and_marks_carried_rows(pareto, tmp_path, monkeypatch):
    monkeypatch.setattr(pareto, "RESULTS", tmp_path)
    measured = [_dense(), _point("leapctl 60% 4-bit", "leapctl", 60.0, 0.44)]
    points = measured + pareto.carried_points(_earlier(tmp_path), measured)
    pareto.write_results(points, "m", "python -m bench.pareto --new")
    md = tmp_path / "pareto_m.md"
    md.write_text(md.read_text() + "A note written by hand.\n")
    pareto.write_results(points, "m", "python -m bench.pareto --new")
    text = md.read_text()
    assert text.count("A note written by hand.") == 1 and text.endswith("A note written by hand.\n")
    rows = [line for line in text.splitlines() if line.startswith("| leapctl") or line.startswith("| llama")]
    assert rows == ["| llama.cpp Q4_0* | 0.670 | 36.00 | 1.261 |",
                    "| leapctl 30% 4-bit* | 0.630 | 33.00 | 1.156 |",
                    "| leapctl 50% 4-bit* | 0.480 | 46.60 | 1.632 |",
                    "| leapctl 60% 4-bit | 0.440 | 60.00 | 2.102 |"]
    assert "* Not scored in this run: carried from `python -m bench.pareto --old` (2026-12-06)." in text
    assert json.loads((tmp_path / "pareto_m.json").read_text())["points"][-1]["carried_from"]
