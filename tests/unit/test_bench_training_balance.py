"""benchmarks/bench_training_balance.py's summary of the race's runs: the windows, the worst
iteration and the mean over seeds are the figures the README's table quotes; a figure a run
cannot give (the window after iteration 50 of a 40-iteration run, tokens/s without timings)
is null in the JSON and "-" in the table, never NaN (which strict JSON readers refuse)."""

import importlib.util
import json
import statistics
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location(
    "bench_training_balance", REPO / "benchmarks" / "bench_training_balance.py"
)
race = importlib.util.module_from_spec(spec)
spec.loader.exec_module(race)


def _records(vio, loss=4.0, tokens_per_s=1000.0):
    return [
        dict(
            iteration=i + 1,
            loss=loss + i * 1e-3,
            tokens_per_s=tokens_per_s,
            maxvio_mean=v,
            maxvio_max=2 * v,
            num_dead=int(v > 5),
            frac_under_half=0.0,
        )
        for i, v in enumerate(vio)
    ]


def test_windows_worst_and_mean_over_seeds():
    a = race.summarize("m", _records([1.0] * 50 + [0.5] * 49 + [3.0]))
    b = race.summarize("m", _records([9.0] + [2.0] * 99, loss=5.0))
    assert (a["maxvio_1_50"], a["maxvio_51_end"], a["maxvio_worst_51_end"]) == (
        1.0,
        pytest.approx(0.55),
        3.0,
    )
    assert (a["maxvio_worst"], a["maxvio_worst_iteration"]) == (3.0, 100)
    assert b["iterations_with_dead_expert"] == 1
    row = race.combine([a, b])
    assert row["maxvio_1_50"] == statistics.fmean([1.0, (9.0 + 49 * 2.0) / 50])
    assert (row["maxvio_worst"], row["maxvio_worst_iteration"]) == (9.0, 1)
    assert row["maxvio_worst_51_end"] == 3.0
    assert row["final_loss_runs"] == [a["final_loss"], b["final_loss"]]
    assert abs(row["final_loss"] - 4.5895) < 1e-9  # 4 + mean(i 80..99)/1000, 5 + the same


def test_a_missing_figure_is_null_and_a_dash():
    short = race.summarize("short run", _records([1.0] * 40, tokens_per_s=float("nan")))
    assert short["maxvio_51_end"] is None and short["tokens_per_s"] is None
    row = race.combine([short, short])
    assert row["maxvio_51_end"] is None and row["maxvio_worst_51_end"] is None
    short["tokens_per_s_rel"] = None  # `none` not in the race
    json.dumps([short, row], allow_nan=False)  # raises on NaN
    line = race.table_rows([short])[1]
    assert "nan" not in line
    cells = line.split()
    assert cells[cells.index("1.000") + 1] == "-"  # the 51-end window
    assert cells[-2:] == ["-", "-"]  # tokens/s: runs and side by side


def test_loss_panel_shows_every_final_loss():
    """The loss panel's top sits above every method's final loss, also when training ends above
    6 (the race at LR 1e-4: a fixed top of 6.0 left the panel empty)."""
    for final in (4.6, 6.33):
        runs = [race.summarize(m, _records([1.0] * 300, loss=final - 0.3)) for m in "ab"]
        for r in runs:
            r["curve_loss"] = [8.3] + r["curve_loss"][1:]  # the first iteration near ln(vocab)
        top = race.loss_axis_top(runs)
        assert max(r["final_loss"] for r in runs) < top < 8.3


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--methods"], "--methods: give at least one"),
        (["--args-file", "/nonexistent/args.sh"], "--args-file /nonexistent/args.sh: no such file"),
        (["--side-by-side-steps", "-1"], "--side-by-side-steps -1: an integer >= 0"),
    ],
)
def test_bad_options_are_refused_before_anything_is_written(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        race.main([*argv, "--out", str(tmp_path / "out"), "--workdir", str(tmp_path / "runs")])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # no run, no result (the headline JSON was wiped)


def test_other_args_files_write_beside_the_races_results():
    """The race of another model never replaces the headline training_balance.json."""
    assert race.results_dir(race.DEFAULT_ARGS_FILE) == race.RESULTS
    wide = str(REPO / "examples" / "args" / "k3_sparse_wide.sh")
    assert race.results_dir(wide) == str(Path(race.RESULTS) / "k3_sparse_wide")


def test_a_finished_run_is_reused_only_with_the_flags_that_trained_it(
    tmp_path, monkeypatch, capsys
):
    """The race reused any JSONL with enough iterations: after a method's flags, the args file,
    --iters or the seed changed, it reported the old run as the new one."""
    args_file = tmp_path / "model.sh"
    args_file.write_text(
        'source "%s"\nARGS+=(--lr 1e-3)\n' % (REPO / "examples" / "args" / "k3_sparse_tiny.sh")
    )
    trained = []

    def fake_run(name, flags, args, jsonl, seed=None):  # a run that trains instantly
        trained.append(name)
        with open(jsonl, "w") as f:
            for r in _records([1.0] * args.iters):
                f.write(json.dumps(r) + "\n")
        race.save_record(jsonl, race.race_command(flags, args, jsonl, seed))
        return 0.0

    monkeypatch.setattr(race, "run_method", fake_run)
    monkeypatch.setattr(
        race,
        "token_floor",
        lambda *a: dict(experts_over_topk=32, mean=0.0, max=0.0, most_frequent_token=0),
    )
    monkeypatch.setattr(race, "plot", lambda *a: None)
    base = ["--args-file", str(args_file), "--methods", "none", "--side-by-side-steps", "0"]
    base += ["--iters", "60", "--workdir", str(tmp_path / "runs"), "--out", str(tmp_path / "out")]

    def race_with(*extra):
        trained.clear()
        race.main([*base, *extra])
        return list(trained)

    assert race_with() == ["none"]
    assert race_with() == []  # the same flags: reused
    assert race_with("--seeds", "7") == ["none seed 7"]
    assert race_with("--seeds", "7") == []
    monkeypatch.setitem(race.METHODS, "none", race.METHODS["none"] + ["--moe-router-topk", "2"])
    assert race_with() == ["none"]  # the method's flags changed
    args_file.write_text(args_file.read_text().replace("1e-3", "2e-3"))
    assert race_with() == ["none"]  # the args file changed
    base[base.index("--iters") + 1] = "70"
    assert race_with() == ["none"]  # other iterations: another LR schedule
    assert "trained with other flags" in capsys.readouterr().out
    (tmp_path / "runs" / "none.cmd.json").unlink()
    assert race_with() == ["none"]  # a run without its record is not trusted
    assert "no record of the flags" in capsys.readouterr().out
