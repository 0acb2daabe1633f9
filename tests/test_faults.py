"""The fault matrix in short (`python -m experiments.faults` runs each fault many times at random
moments): one run of the faults the other tests do not inject, with real processes."""

from __future__ import annotations

import json

import pytest

from experiments import faults


@pytest.mark.slow  # real processes killed and restarted: ~60 s
def test_fault_matrix_short(tmp_path):
    out = tmp_path / "faults.json"
    rc = faults.main(["--runs", "1", "--faults", "link-stall,client-kill,other-weights,disk-full", "--seed", "3",
                      "--max-new-tokens", "24", "--out", str(out)])
    report = json.loads(out.read_text())
    assert rc == 0, json.dumps(report["runs"], indent=1)[:3000]
    assert {f: v["runs"] for f, v in report["summary"].items()} == {
        "link-stall": 1, "client-kill": 1, "other-weights": 1, "disk-full": 1}
    killed = report["runs"]["client-kill"][0]
    assert killed["held_bytes"] > 0 and killed["freed_after_s"] <= faults.FREE_BOUND_S
    assert "weights" in report["runs"]["other-weights"][0]["error"]
    full = report["runs"]["disk-full"][0]
    assert full["first_rc"] != 0 and full["clear_error"] and full["resume_rc"] == 0
