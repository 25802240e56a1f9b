"""tools/plot_balance.py reads the balance JSONL of any balancer: the summary counts iterations
with a dead expert and the worst MaxVio; the picture is written."""

import json
import math
import os
import subprocess
import sys
from functools import partial

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


TOOL = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "plot_balance.py")


def _run(*args):
    return subprocess.run(
        [sys.executable, TOOL, *map(str, args)], capture_output=True, text=True, timeout=120
    )


def _balance_file(tmp_path):
    path = tmp_path / "balance.jsonl"
    path.write_text("".join(json.dumps(_record(i, 1.0, 0)) + "\n" for i in (1, 2, 3)))
    return path


@pytest.mark.parametrize("window", ["0", "-3"])
def test_window_below_one_is_refused(tmp_path, window):
    path = _balance_file(tmp_path)
    r = _run(path, "--summary", "--window", window, "--out", tmp_path / "p.png")
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    want = f"plot_balance.py: error: --window={window} is not allowed: an integer >= 1\n"
    assert r.stderr == want
    assert r.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["balance.jsonl"]


def test_out_in_a_missing_directory_is_refused_up_front(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "missing" / "x.png"
    r = _run(_balance_file(tmp_path), "--out", out, "--summary")
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.startswith(
        f"plot_balance.py: error: --out={str(out)!r}: directory {str(out.parent)!r} does not exist"
    ), r.stderr
    assert r.stderr.count("\n") == 1 and r.stdout == ""  # refused before any work
    assert sorted(p.name for p in tmp_path.iterdir()) == ["balance.jsonl"]


def test_failed_picture_write_leaves_the_previous_picture(tmp_path, monkeypatch):
    """The picture goes through a temporary file and a rename: a write that fails half-way leaves
    neither a partial picture nor a temporary file, and the previous picture stays."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    def savefig_then_fail(self, fname, *args, **kwargs):
        if isinstance(fname, (str, os.PathLike)):
            with open(fname, "wb") as f:
                f.write(b"half a picture")
        else:
            fname.write(b"half a picture")
        raise OSError("No space left on device")

    records = plot_balance.read_records(str(_balance_file(tmp_path)))
    out = tmp_path / "p.png"
    out.write_bytes(b"previous picture")
    monkeypatch.setattr(Figure, "savefig", savefig_then_fail)
    with pytest.raises(OSError, match="No space left"):
        plot_balance.plot(records, str(out), window=2)
    assert out.read_bytes() == b"previous picture"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["balance.jsonl", "p.png"]
    monkeypatch.undo()
    assert plot_balance.plot(records, str(out), window=2) == str(out)
    assert out.stat().st_size > 10_000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["balance.jsonl", "p.png"]


def test_heatmap_layer_labels_stay_readable_with_many_layers(tmp_path, monkeypatch):
    """A K3-deep model (60 MoE layers, layer 1 dense) gets at most 24 layer labels per heatmap,
    the first MoE layer's among them (one label per layer overlapped into a black bar)."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    def record(it):
        base = _record(it, 0.5, 0)
        base["layers"] = [dict(base["layers"][0], layer=n) for n in range(2, 62)]
        return base

    labels = []
    save = Figure.savefig

    def spy(fig, *args, **kwargs):
        labels.extend(
            [t.get_text() for t in ax.get_yticklabels()]
            for ax in fig.axes
            if ax.get_ylabel() == "layer"
        )
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", spy)
    plot_balance.plot([record(1), record(2)], str(tmp_path / "many.png"), window=1)
    assert len(labels) == 2, labels  # both heatmaps
    for axis in labels:
        assert 10 <= len(axis) <= 24 and axis[0] == "2", axis
        assert all(label.isdigit() and 2 <= int(label) <= 61 for label in axis), axis


def test_picture_names_its_run_without_title(tmp_path, monkeypatch):
    """Without ``--title`` the picture's title is the JSONL's path (which run it shows)."""
    path = tmp_path / "run7" / "balance.jsonl"
    path.parent.mkdir()
    path.write_text(json.dumps(_record(1, 0.5, 0)) + "\n")
    seen = []
    monkeypatch.setattr(plot_balance, "plot", lambda r, out, w, title: seen.append(title) or out)
    assert plot_balance.main([str(path), "--out", str(tmp_path / "p.png")]) == 0
    assert plot_balance.main([str(path), "--out", str(tmp_path / "p.png"), "--title", "T"]) == 0
    assert seen == [str(path), "T"]


def _summary_row(it, loss, vio, vio_max, dead, tps):
    row = dict(iteration=it, loss=loss, maxvio_max=vio_max, num_dead=dead)
    if vio != "absent":
        row["maxvio_mean"] = vio
    if tps != "absent":
        row["tokens_per_s"] = tps
    return row


# iteration, loss, MaxVio mean, MaxVio max, dead experts, tokens/s
_SUMMARY_ROWS = [
    (1, 8.0, 2.0, 3.0, 2, 100.0),
    (2, 7.0, float("nan"), 2.5, 0, 200.0),  # NaN MaxVio: left out of the means
    (3, 6.0, 1.0, 2.0, 0, "absent"),
    (4, float("nan"), 0.3, 0.3, 0, 50.0),  # no loss (no tokens): not a row at all
    (5, 5.0, 0.5, 1.0, None, 300.0),  # null dead count: none
    (6, 4.0, 0.4, 0.8, 1, 400.0),
    (7, 3.0, "absent", 0.6, 0, 500.0),
    (8, 2.0, 0.2, 0.4, 0, 600.0),
]


def test_summary_windows_against_a_hand_count(tmp_path):
    """The first / last windows of the rows with a finite loss, each mean over the finite values
    only (NaN, null and missing fields left out), the window capped at half the rows."""
    path = tmp_path / "balance.jsonl"
    lines = ["{cut by a kill", "", json.dumps({"note": "no iteration"})]
    lines += [json.dumps(_summary_row(*row)) for row in _SUMMARY_ROWS]
    path.write_text("\n".join(lines) + "\n")
    records = plot_balance.read_records(str(path))
    assert [r["iteration"] for r in records] == [1, 2, 3, 4, 5, 6, 7, 8]
    approx = partial(pytest.approx, rel=1e-12)
    # 7 rows (iteration 4 has no loss): windows of 2 = rows of iterations 1, 2 and 7, 8
    s = plot_balance.summarize(records, window=2)
    assert s == dict(
        iterations=(1, 8),
        window=2,
        loss_first=7.5,
        loss_last=2.5,
        maxvio_first=2.0,
        maxvio_last=approx(0.2),
        maxvio_max_last=approx(0.5),
        dead_iterations=2,
        maxvio_worst=2.0,
        tokens_per_s_last=550.0,
    )
    assert plot_balance.summary_lines(s) == [
        "iterations 1-8 (windows of 2):",
        "  lm loss   7.5000 (first 2) -> 2.5000 (last 2)  [went DOWN]",
        "  MaxVio    mean over layers 2.000 -> 0.200  (max over layers, last 2: 0.500; worst "
        "iteration 2.000)",
        "  dead experts in 2 iteration(s)",
        "  tokens/s  550 (last 2)",
    ]
    # the default window (20) is capped at 7 // 2 = 3: iterations 1, 2, 3 and 6, 7, 8
    s = plot_balance.summarize(records)
    assert (s["window"], s["loss_first"], s["loss_last"]) == (3, 7.0, 3.0)
    assert s["maxvio_first"] == 1.5 and s["maxvio_last"] == approx(0.3)
    assert s["maxvio_max_last"] == approx(0.6) and s["tokens_per_s_last"] == 500.0
    # a window below 1 counts as 1
    assert plot_balance.summarize(records, window=0)["window"] == 1


def test_summary_of_a_long_run_uses_windows_of_20():
    records = [dict(iteration=i, loss=float(100 - i)) for i in range(1, 46)]
    s = plot_balance.summarize(records)
    assert s["window"] == plot_balance.SUMMARY_WINDOW == 20
    assert (s["loss_first"], s["loss_last"]) == (89.5, 64.5)  # 100 - 10.5, 100 - 35.5
    assert math.isnan(s["maxvio_first"]) and math.isnan(s["tokens_per_s_last"])  # not recorded


def test_summary_of_one_iteration_and_of_none():
    (line,) = plot_balance.summary_lines(plot_balance.summarize([]))
    assert line == "no iterations with a loss in the file"
    assert plot_balance.summarize([dict(iteration=3, loss=float("nan"))]) == {}
    s = plot_balance.summarize([dict(iteration=3, loss=4.0, maxvio_mean=0.5)])
    assert (s["iterations"], s["window"], s["loss_first"], s["loss_last"]) == ((3, 3), 1, 4.0, 4.0)
    assert plot_balance.summary_lines(s)[:2] == [
        "iterations 3-3 (windows of 1):",
        "  lm loss   4.0000 (first 1) -> 4.0000 (last 1)  [did NOT go down]",
    ]


def test_a_true_iteration_is_refused_not_read_as_iteration_1(tmp_path):
    """JSON ``true`` is a Python int (True == 1): read, it would replace iteration 1's record."""
    path = tmp_path / "b.jsonl"
    path.write_text('{"iteration": 1, "loss": 4.0}\n{"iteration": true, "loss": 9.0}\n')
    with pytest.raises(ValueError, match="line 2: iteration true is not an integer"):
        plot_balance.read_records(str(path))


def test_records_come_in_iteration_order_and_a_field_that_is_not_a_number_is_left_out(tmp_path):
    """Lines out of order (files joined, a run resumed from an older checkpoint) are read in
    iteration order; a text or list where a number belongs (a hand-edited or foreign file) is left
    out of the means like a missing field, not a crash."""
    path = tmp_path / "b.jsonl"
    rows = [
        dict(iteration=3, loss=1.0, maxvio_mean="n/a", tokens_per_s=[5]),
        dict(iteration=1, loss=3.0, maxvio_mean=0.5, tokens_per_s=10.0),
        dict(iteration=2, loss="?", maxvio_mean=0.25),
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    records = plot_balance.read_records(str(path))
    assert [r["iteration"] for r in records] == [1, 2, 3]
    s = plot_balance.summarize(records, window=1)
    assert (s["iterations"], s["loss_first"], s["loss_last"]) == ((1, 3), 3.0, 1.0)
    assert s["maxvio_first"] == s["maxvio_worst"] == 0.5 and math.isnan(s["maxvio_last"])
    assert math.isnan(s["tokens_per_s_last"])


def test_load_matrix_is_the_mean_load_over_mean_per_layer():
    """The heatmap's numbers: per layer, load / mean load averaged over the records that carry
    loads for it; a layer without loads, or with none routed (mean 0), is left out."""
    records = [
        {"layers": [{"layer": 3, "loads": [2, 6]}, {"layer": 1, "loads": [0, 0]}, {"layer": 2}]},
        {"layers": [{"layer": 3, "loads": [4, 4]}, {"layer": 1, "loads": [1, 3]}]},
        {"iteration": 9},
    ]
    matrix, layers = plot_balance._load_matrix(records)
    assert layers == [1, 3]
    assert matrix == [[0.5, 1.5], [0.75, 1.25]]
    assert plot_balance._load_matrix(records[2:]) == (None, [])


def test_load_matrix_leaves_out_loads_of_another_length():
    """Files of two runs joined: a layer's loads of another length than its first are left out
    (they were an IndexError traceback)."""
    records = [
        {"layers": [{"layer": 1, "loads": [1, 3]}]},
        {"layers": [{"layer": 1, "loads": [1, 1, 1]}]},
        {"layers": [{"layer": 1, "loads": [2, 2]}]},
    ]
    assert plot_balance._load_matrix(records) == ([[0.75, 1.25]], [1])


def _drawn(monkeypatch):
    """The figures ``plot`` saves, kept open for the test to read."""
    from matplotlib.figure import Figure

    figures, save = [], Figure.savefig

    def spy(fig, *args, **kwargs):
        figures.append(fig)
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", spy)
    return figures


def test_picture_shows_the_first_and_the_last_window(tmp_path, monkeypatch):
    """Left heatmap: the first iteration; right: the mean over the last --window iterations
    (all of them when the window is longer); the dead-expert curve is a fraction of layers x
    experts; the title is the run's."""
    pytest.importorskip("matplotlib")
    records = [_record(1, 2.5, 1), _record(2, 0.8, 0), _record(3, 1.2, 2)]
    records[1]["layers"][0]["loads"] = [4, 4, 4, 4]
    records[2]["layers"][0]["loads"] = [8, 0, 0, 0]
    figures = _drawn(monkeypatch)
    for window in (2, 10):
        plot_balance.plot(records, str(tmp_path / f"w{window}.png"), window, title="run 7")
    rel = {1: [9 / 4.25, 0, 4 / 4.25, 4 / 4.25], 2: [1, 1, 1, 1], 3: [4, 0, 0, 0]}  # load / mean
    for fig, first in zip(figures, (2, 1), strict=True):
        heat = [ax for ax in fig.axes if ax.get_ylabel() == "layer"]
        assert [ax.get_title() for ax in heat] == [
            "expert load / mean load — iteration 1",
            f"expert load / mean load — mean of iterations {first}-3",
        ]
        want = [sum(rel[i][e] for i in range(first, 4)) / (4 - first) for e in range(4)]
        assert heat[0].images[0].get_array().tolist() == [pytest.approx(rel[1])]
        assert heat[1].images[0].get_array().tolist() == [pytest.approx(want)]
        assert fig.get_suptitle() == "run 7"
        (twin,) = [ax for ax in fig.axes if ax.get_ylabel() == "fraction of experts"]
        assert list(twin.lines[1].get_ydata()) == [1 / 4, 0, 2 / 4]  # 1 layer x 4 experts


def test_a_layer_entry_missing_a_field_is_left_out_of_the_picture(tmp_path, monkeypatch):
    """A hand-edited or foreign line: a layer without max_vio, with a text there or without its
    number, loads that are not numbers, "layers" that is not a list. The rest is drawn (no
    KeyError, no TypeError): each layer's thin MaxVio line has the iterations that carry its
    max_vio as a number."""
    pytest.importorskip("matplotlib")
    records = [_record(1, 2.5, 1), _record(2, 0.8, 0), _record(3, 1.2, 2), _record(4, 0.5, 0)]
    del records[1]["layers"][0]["max_vio"]
    records[2]["layers"].append({"max_vio": 7.0, "loads": [1, 1, 1, 1]})  # no layer number
    records[2]["layers"][0]["loads"] = [1, None, 2, 3]
    records[3]["layers"] = None
    records.append(_record(5, 0.5, 0))
    records[4]["layers"][0].update(max_vio="n/a", loads=None)
    figures = _drawn(monkeypatch)
    plot_balance.plot(records, str(tmp_path / "p.png"), window=10)
    (fig,) = figures
    (vio,) = [ax for ax in fig.axes if ax.get_title().startswith("load balance per iteration")]
    thin = [line for line in vio.lines if line.get_label().startswith("_")]
    assert [(list(t.get_xdata()), list(t.get_ydata())) for t in thin] == [([1, 3], [2.5, 1.2])]
    heat = [ax for ax in fig.axes if ax.get_ylabel() == "layer"]
    assert heat[1].get_title() == "expert load / mean load — mean of iterations 1-3"
    rel = [[9 / 4.25, 0, 4 / 4.25, 4 / 4.25], [9 / 5, 3 / 5, 4 / 5, 4 / 5]]  # iterations 1, 2
    want = [(a + b) / 2 for a, b in zip(*rel, strict=True)]  # iteration 3's loads left out
    assert heat[1].images[0].get_array().tolist() == [pytest.approx(want)]


def test_a_top_level_field_that_is_not_a_number_is_a_gap_in_the_picture(tmp_path, monkeypatch):
    """A text where a number belongs (a hand-edited or foreign line) is left out of the curves
    as the summary leaves it out of its means (it was a TypeError traceback while plotting)."""
    pytest.importorskip("matplotlib")
    records = [_record(1, 2.5, 1), _record(2, 0.8, 0)]
    records[0].update(maxvio_mean="n/a", maxvio_max=[1], frac_under_half="x", num_experts="4")
    records[1].update(loss="?", num_dead="2")
    figures = _drawn(monkeypatch)
    plot_balance.plot(records, str(tmp_path / "p.png"), window=10)
    (fig,) = figures
    (vio,) = [ax for ax in fig.axes if ax.get_title().startswith("load balance per iteration")]
    mean, worst = (line for line in vio.lines if not line.get_label().startswith("_"))
    assert list(mean.get_ydata()) == [1e-3, 0.8] and list(worst.get_ydata()) == [1e-3, 0.8]
    (twin,) = [ax for ax in fig.axes if ax.get_ylabel() == "fraction of experts"]
    under, dead = (list(line.get_ydata()) for line in twin.lines)
    assert math.isnan(under[0]) and under[1] == 0.25
    assert dead == [1.0, 0.0]  # 1 dead of 1 layer x 1 expert: num_experts "4" is not a number
    (loss,) = [ax for ax in fig.axes if ax.get_title() == "training loss"]
    ys = list(loss.lines[0].get_ydata())
    assert ys[0] == 4.9 and math.isnan(ys[1])


def test_first_heatmap_is_the_first_iteration_that_recorded_loads(tmp_path, monkeypatch):
    """With --balance-log-loads-interval most records carry no loads: the left heatmap is the
    first record that has them, not an empty panel for the run's first iteration."""
    pytest.importorskip("matplotlib")
    records = [_record(1, 2.5, 1), _record(2, 0.8, 0), _record(3, 1.2, 0)]
    del records[0]["layers"][0]["loads"]
    records[2]["layers"][0]["loads"] = [8, 0, 0, 0]
    figures = _drawn(monkeypatch)
    plot_balance.plot(records, str(tmp_path / "p.png"), window=1)
    (fig,) = figures
    heat = [ax for ax in fig.axes if ax.get_ylabel() == "layer"]
    assert [ax.get_title() for ax in heat] == [
        "expert load / mean load — iteration 2",
        "expert load / mean load — mean of iterations 3-3",
    ]
    assert heat[0].images[0].get_array().tolist() == [pytest.approx([9 / 5, 3 / 5, 4 / 5, 4 / 5])]
    assert heat[1].images[0].get_array().tolist() == [[4.0, 0.0, 0.0, 0.0]]
    # one colour scale for both panels, 1.0 (balanced) in its middle
    assert [ax.images[0].get_clim() for ax in heat] == [(0.0, 2.0), (0.0, 2.0)]


def test_maxvio_panel_with_two_layers(tmp_path, monkeypatch):
    """The dead-expert curve is a fraction of all layers' experts (2 layers x 4 experts); a
    balanced layer's MaxVio 0 is drawn at the log axis' floor 1e-3 (log scale drops a 0); the
    fractions' axis spans 0-1."""
    pytest.importorskip("matplotlib")

    def record(it, vio, dead):
        base = _record(it, vio, dead)
        base["layers"] = [dict(base["layers"][0], layer=n) for n in (2, 3)]
        return base

    records = [record(1, 0.0, 1), record(2, 0.5, 2)]
    figures = _drawn(monkeypatch)
    plot_balance.plot(records, str(tmp_path / "p.png"), window=1)
    (fig,) = figures
    (vio,) = [ax for ax in fig.axes if ax.get_title().startswith("load balance per iteration")]
    thin = [line for line in vio.lines if line.get_label().startswith("_")]
    assert [list(t.get_ydata()) for t in thin] == [[1e-3, 0.5], [1e-3, 0.5]]
    (twin,) = [ax for ax in fig.axes if ax.get_ylabel() == "fraction of experts"]
    assert list(twin.lines[1].get_ydata()) == [1 / 8, 2 / 8]
    assert twin.get_ylim() == (0.0, 1.0)


@pytest.mark.parametrize("experts, ticks", [(32, list(range(32))), (33, None)])
def test_heatmap_labels_every_expert_up_to_32(tmp_path, monkeypatch, experts, ticks):
    pytest.importorskip("matplotlib")
    record = _record(1, 0.5, 0)
    record["layers"][0]["loads"] = [1 + e % 3 for e in range(experts)]
    figures = _drawn(monkeypatch)
    plot_balance.plot([record], str(tmp_path / "p.png"), window=1)
    heat = [ax for ax in figures[0].axes if ax.get_ylabel() == "layer"]
    for ax in heat:
        got = [int(t) for t in ax.get_xticks()]
        assert got == ticks if ticks else len(got) < experts, got


def test_a_boolean_layer_number_is_not_a_layer():
    """``"layer": true`` is not read as layer 1 (as an iteration ``true`` is refused)."""
    record = {"layers": [{"layer": True, "max_vio": 1.0}, {"layer": 2, "max_vio": 0.5}, 3]}
    assert list(plot_balance._layers(record)) == [{"layer": 2, "max_vio": 0.5}]


def test_out_is_checked_as_matplotlib_writes_it(tmp_path, monkeypatch):
    """--out without an extension gets matplotlib's default format appended (what savefig
    does); the extension's case does not matter; a folder (with or without the extension
    appended: --out RUN wrote RUN.png beside the run's folder, --out RUN/ a hidden RUN/.png), an
    unknown format or a folder without write permission is refused naming --out."""
    pytest.importorskip("matplotlib")
    records = plot_balance.read_records(str(_balance_file(tmp_path)))
    assert plot_balance.plot(records, str(tmp_path / "pic"), 2) == str(tmp_path / "pic.png")
    assert (tmp_path / "pic.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a trailing dot is dropped before the format is appended, as savefig does
    assert plot_balance.plot(records, str(tmp_path / "dot."), 2) == str(tmp_path / "dot.png")
    assert (tmp_path / "dot.png").is_file() and not (tmp_path / "dot..png").exists()
    assert plot_balance.check_out(str(tmp_path / "P.PNG")) is None
    os.makedirs(tmp_path / "dir.png")
    for folder in (str(tmp_path), f"{tmp_path}/", str(tmp_path / "dir.png"), str(tmp_path / "dir")):
        assert plot_balance.check_out(folder) == (
            f"--out={folder!r} is a directory (a picture file such as RUN/expert_load.png is "
            "expected)"
        )
    bad = plot_balance.check_out(str(tmp_path / "x.docx"))
    assert bad.startswith(f"--out={str(tmp_path / 'x.docx')!r}: picture format 'docx' is not ")
    assert "allowed: one of " in bad and ", png, " in bad
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # the tests run as root
    assert plot_balance.check_out(str(tmp_path / "x.png")) == (
        f"--out={str(tmp_path / 'x.png')!r}: directory {str(tmp_path)!r} is not writable"
    )


def test_cli_exit_status_and_output(tmp_path, capsys, monkeypatch):
    """main() in-process: --summary prints the summary with the given window; --out names the
    picture written; a missing, empty or non-JSONL file is exit 1 and one line (a binary file was
    a UnicodeDecodeError traceback); nothing to do is a usage error, exit 2, even before a
    missing file is named."""
    path = tmp_path / "balance.jsonl"
    rows = [_record(1, 2.0, 0), _record(2, 1.0, 0), _record(3, 0.5, 0), _record(4, 0.25, 0)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert plot_balance.main([str(path), "--summary", "--window", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == [
        "iterations 1-4 (windows of 1):",
        "  lm loss   4.9000 (first 1) -> 4.6000 (last 1)  [went DOWN]",
    ]
    monkeypatch.setattr(plot_balance, "plot", lambda r, out, w, title: out + ".png")
    assert plot_balance.main([str(path), "--out", str(tmp_path / "p")]) == 0
    assert capsys.readouterr().out == f"expert-load picture: {tmp_path / 'p'}.png\n"
    picture = tmp_path / "p.png"
    picture.write_bytes(b"\x89PNG\r\n\x1a\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    unnumbered = tmp_path / "unnumbered.jsonl"
    unnumbered.write_text('{"iteration": 1}\n{"iteration": null}\n')
    assert plot_balance.main([str(tmp_path / "no.jsonl")]) == 2
    assert capsys.readouterr() == (
        "",
        "plot_balance.py: error: nothing to do: give --out PICTURE and/or --summary\n",
    )
    for argv, message in (
        (
            [str(tmp_path / "no.jsonl"), "--summary"],
            f"plot_balance.py: error: [Errno 2] No such file or directory: "
            f"{str(tmp_path / 'no.jsonl')!r}",
        ),
        ([str(empty), "--summary"], f"plot_balance.py: error: no records in {empty}"),
        (
            [str(picture), "--summary"],
            f"plot_balance.py: error: {picture}: not a balance JSONL ('utf-8' codec can't "
            "decode byte 0x89 in position 0: invalid start byte)",
        ),
        (
            [str(unnumbered), "--summary"],
            f"plot_balance.py: error: {unnumbered}: not a balance JSONL (line 2: iteration null "
            "is not an integer)",
        ),
    ):
        assert plot_balance.main(argv) == 1, argv
        assert capsys.readouterr() == ("", message + "\n"), argv
