"""The results tables of README.md and docs/results.md are what tools/tables.py builds from the raw results
committed under docs/raw/: a figure edited by hand, or a raw run replaced without its table, fails here."""

from __future__ import annotations

import json
import shutil

from tools import tables


def test_every_generated_table_equals_its_rebuild_from_the_raw_results():
    found = 0
    for doc in tables.DOCS:
        text = doc.read_text()
        found += len(tables.BLOCK.findall(text))
        rebuilt, changed = tables.rebuild(text)
        assert changed == [], f"{doc.name}: run `.venv/bin/python tools/tables.py` ({changed})"
        assert rebuilt == text
    assert found >= 6  # the headline tables, each from its run


def test_a_figure_that_moves_in_the_raw_results_moves_the_table(tmp_path, monkeypatch):
    run = next(p for p in (tables.RAW / "footprint").glob("*.json"))
    raw = tmp_path / "raw"
    shutil.copytree(tables.RAW, raw)
    monkeypatch.setattr(tables, "RAW", raw)
    doc = next(d.read_text() for d in tables.DOCS if f"footprint/{run.name}" in d.read_text())
    data = json.loads(run.read_text())
    data["median"]["moaspec"]["decode_tok_s"] *= 2
    (raw / "footprint" / run.name).write_text(json.dumps(data))
    _, changed = tables.rebuild(doc)
    assert any(f"footprint/{run.name}" in spec for spec in changed)
