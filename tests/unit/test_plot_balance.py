"""tools/plot_balance.py reads the balance JSONL of any balancer: the summary counts iterations
with a dead expert and the worst MaxVio; the picture is written."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from tools import plot_balance  # noqa: E402


def _record(it, vio, dead):
    layer = dict(
        layer=2,
        max_vio=vio,
        min_load=0 if dead else 3,
        max_load=9,
        frac_under_half=0.25,
        num_dead=dead,
        num_tokens=16,
        loads=[9, 0 if dead else 3, 4, 4],
    )
    return dict(
        iteration=it,
        loss=5.0 - 0.1 * it,
        tokens_per_s=100.0,
        maxvio_mean=vio,
        maxvio_max=vio,
        min_load=layer["min_load"],
        max_load=9,
        frac_under_half=0.25,
        num_dead=dead,
        num_experts=4,
        layers=[layer],
    )


def test_summary_and_picture(tmp_path):
    path = tmp_path / "balance.jsonl"
    rows = [_record(1, 2.5, 1), _record(2, 0.8, 0), _record(3, 1.2, 2), _record(2, 0.5, 0)]
    path.write_text(
        "".join(json.dumps(r) + "\n" for r in rows) + '{"iteration": 4, "lo'
    )  # cut line
    records = plot_balance.read_records(str(path))
    assert [r["iteration"] for r in records] == [1, 2, 3]  # last record of iteration 2 wins
    s = plot_balance.summarize(records, window=1)
    assert s["dead_iterations"] == 2 and s["maxvio_worst"] == pytest.approx(2.5)
    text = "\n".join(plot_balance.summary_lines(s))
    assert "dead experts in 2 iteration(s)" in text and "worst iteration 2.500" in text
    pytest.importorskip("matplotlib")
    out = tmp_path / "balance.png"
    plot_balance.plot(records, str(out), window=2)
    assert out.stat().st_size > 10_000
