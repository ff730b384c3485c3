"""bench/quality/prune.py's bookkeeping (`python -m bench.quality prune`): which rows of the last results file
a partial rerun keeps, the table order, and --leap overrides. An hour of LEAP is redone alone, so losing or
duplicating the other rows would silently corrupt the published table."""

import json
from types import SimpleNamespace

import pytest


@pytest.fixture(scope="module")
def quality():
    from bench.quality import prune

    return prune


META = {
    "calibration": {"source": "wiki-summaries", "nsamples": 128, "seq_len": 512, "seed": 0, "seconds": 3.0},
    "eval": {"text": "WikiText-2 test", "seq_len": 512, "max_tokens": 16384},
}


def _row(method: str, target: float | None, ppl: float) -> dict:
    return {"method": method, "target": target, "achieved": target, "seconds": 1.0, "ppl": ppl}


def _earlier_file(quality, tmp_path, monkeypatch, meta: dict) -> SimpleNamespace:
    monkeypatch.setattr(quality, "RESULTS", tmp_path)
    rows = [_row("dense", None, 28.8), _row("wanda", 0.5, 62.6), _row("leap", 0.5, 71.6),
            _row("wanda", 0.6, 158.2), _row("leap", 0.6, 108.2)]  # fmt: skip
    (tmp_path / "quality_m.json").write_text(json.dumps({**meta, "runs": rows}))
    return SimpleNamespace(name="m")


def test_a_partial_rerun_keeps_every_other_row_of_the_same_setup(quality, tmp_path, monkeypatch):
    setup = _earlier_file(quality, tmp_path, monkeypatch, META)
    this_run = {**META, "calibration": {**META["calibration"], "seconds": 4.2}}  # timing is not the setup
    kept = quality._rows_kept_from_earlier(setup, this_run, ["leap"], [0.5])
    assert [(r["method"], r["target"]) for r in kept] == [("wanda", 0.5), ("wanda", 0.6), ("leap", 0.6)]


def test_rows_from_another_calibration_or_eval_are_not_kept(quality, tmp_path, monkeypatch):
    setup = _earlier_file(quality, tmp_path, monkeypatch, META)
    other_seed = {**META, "calibration": {**META["calibration"], "seed": 1}}
    whole_text = {**META, "eval": {**META["eval"], "max_tokens": None}}
    assert quality._rows_kept_from_earlier(setup, other_seed, ["leap"], [0.5]) == []
    assert quality._rows_kept_from_earlier(setup, whole_text, ["leap"], [0.5]) == []
    assert quality._rows_kept_from_earlier(SimpleNamespace(name="absent"), META, ["leap"], [0.5]) == []


def test_table_order_is_dense_then_highest_sparsity_then_method_order(quality):
    rows = [_row("leap", 0.5, 1), _row("wanda", 0.6, 2), _row("dense", None, 3), _row("sparsegpt", 0.5, 4),
            _row("leap", 0.6, 5), _row("wanda", 0.5, 6)]  # fmt: skip
    ordered = [(r["method"], r["target"]) for r in quality._table_order(rows)]
    assert ordered == [("dense", None), ("wanda", 0.6), ("leap", 0.6), ("wanda", 0.5), ("sparsegpt", 0.5),
                       ("leap", 0.5)]  # fmt: skip


def test_leap_overrides_read_literals_and_reject_unknown_fields(quality):
    assert quality._leap_override("steps=720") == ("steps", 720)
    assert quality._leap_override("lr=0.02") == ("lr", 0.02)
    assert quality._leap_override("autocast=false") == ("autocast", False)
    assert quality._leap_override("init=wanda-small") == ("init", "wanda-small")
    for bad in ("stpes=720", "steps"):
        with pytest.raises(SystemExit):
            quality._leap_override(bad)


def test_layer_rows_partition_the_block_linears_by_kind_and_by_depth(stories260k_dir):
    """`bench.quality layers` gives weights back by kind and by thirds of the blocks: each family of rows must
    cover every decoder linear exactly once, or a share of the 4-bit cost would be counted twice or lost."""
    from bench.quality.layers import LM_HEAD, linear_weights, variant_names
    from leapctl.models import load_model

    model, _ = load_model(str(stories260k_dir))
    rows = variant_names(model)
    every = rows.pop("every block linear 16-bit")
    assert sorted(every) == sorted(linear_weights(model)) and len(every) == 7 * model.config.num_hidden_layers
    assert rows.pop("lm_head 16-bit") == [LM_HEAD]
    kinds = [names for label, names in rows.items() if not label.startswith("blocks")]
    thirds = [names for label, names in rows.items() if label.startswith("blocks")]
    assert len(kinds) == 7 and len(thirds) == 3
    for family in (kinds, thirds):
        assert sorted(name for names in family for name in names) == sorted(every)
