"""benchmarks/bench_training_balance.py's summary of the race's runs: the windows, the worst
iteration and the mean over seeds are the figures the README's table quotes; a figure a run
cannot give (the window after iteration 50 of a 40-iteration run, tokens/s without timings)
is null in the JSON and "-" in the table, never NaN (which strict JSON readers refuse)."""

import argparse
import json
import statistics
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import bench_training_balance as race

REPO = Path(__file__).resolve().parents[2]


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


def test_tokens_per_s_after_the_warm_up_and_every_figure_averaged_over_seeds():
    a = _records([1.0] * 60)
    for r in a:
        r["tokens_per_s"] = 10.0 * r["iteration"]  # iterations 1-5 (the warm-up) left out
    a = race.summarize("m", a)
    b = race.summarize("m", _records([9.0] * 60, loss=5.0, tokens_per_s=500.0))
    assert a["tokens_per_s"] == 330.0  # the median of iterations 6-60
    assert b["curve_maxvio_max"] == [18.0] * 60 and b["iterations_with_dead_expert"] == 60
    row = race.combine([b, a])
    assert row["maxvio_worst"] == 9.0  # the worst run's, also when it is not the last
    assert row["iterations_with_dead_expert"] == 30.0 and row["tokens_per_s"] == 415.0
    assert row["curve_maxvio"] == [5.0] * 60 and row["curve_maxvio_max"] == [10.0] * 60
    assert row["curve_loss"][-1] == pytest.approx(4.5 + 59e-3)
    assert row["final_loss"] == pytest.approx(4.5 + 49.5e-3)
    assert row["final_loss_sd"] == pytest.approx(0.5**0.5)  # the sample SD of two runs 1 apart


def test_table_columns_line_up_for_long_names_and_missing_figures():
    full = race.summarize("none", _records([1.0] * 60))
    full["tokens_per_s_rel"] = 1.0
    long_name = max(race.METHODS, key=len)
    short = race.summarize(long_name, _records([1.0] * 40, tokens_per_s=float("nan")))
    short["tokens_per_s_rel"] = None
    header, *rows = race.table_rows([full, short])
    assert len(long_name) > 34
    assert [len(r) for r in rows] == [len(header)] * 2
    assert rows[1].startswith(long_name + " ") and rows[1].endswith(" -")


def test_loss_curve_is_a_running_mean():
    assert race._running_mean([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
    assert race._running_mean([3.0, 6.0, 0.0, 3.0], 3) == [3.0, 4.5, 3.0, 3.0]


def test_a_missing_figure_is_null_and_a_dash():
    short = race.summarize("short run", _records([1.0] * 40, tokens_per_s=float("nan")))
    assert short["maxvio_51_end"] is None and short["tokens_per_s"] is None
    row = race.combine([short, short])
    assert row["maxvio_51_end"] is None and row["maxvio_worst_51_end"] is None
    assert race._of_all(max, [1.0, None]) is None and race._of_all(max, [None, 1.0]) is None
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
        (["--iters", "50"], "--iters 50: must be > 50 (the windows are 1-50 and 51-end)"),
        (["--out", "{tmp}/x.json"], "--out {tmp}/x.json: a folder is needed"),
    ],
)
def test_bad_options_are_refused_before_anything_is_written(
    argv, message, capsys, tmp_path, monkeypatch
):
    argv = [w.format(tmp=tmp_path) for w in argv]
    # an option let through must fail here, not start the race's real training
    monkeypatch.setattr(race, "run_method", lambda *a, **k: pytest.fail("it trained"))
    with pytest.raises(SystemExit) as exc:
        race.main(["--out", str(tmp_path / "out"), "--workdir", str(tmp_path / "runs"), *argv])
    assert exc.value.code == 2
    assert message.format(tmp=tmp_path) in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # no run, no result (the headline JSON was wiped)


def test_a_relative_args_file_is_made_absolute_and_on_request_methods_left_out(monkeypatch):
    """The runs start in the repository, not where the user typed the path."""
    monkeypatch.chdir(REPO / "examples")
    p = argparse.ArgumentParser()
    race.add_model_and_method_args(p)
    args = p.parse_args(["--args-file", "args/k3_sparse_tiny.sh"])
    race.check_model_and_method_args(p, args)
    assert args.args_file == race.DEFAULT_ARGS_FILE
    assert args.methods[0] == "none" and not set(args.methods) & set(race.ON_REQUEST)


def test_the_committed_race_is_what_the_readmes_command_writes():
    """benchmarks/results/training_balance.json (the README's table and picture) holds every
    default method in the default order, over the README's seeds: `--seeds 1234 1 2` reproduces it
    row for row (a row added to METHODS, or to ON_REQUEST, without a re-run fails here)."""
    results = json.loads((Path(race.RESULTS) / "training_balance.json").read_text())
    default = [m for m in race.METHODS if m not in race.ON_REQUEST]
    assert [m["method"] for m in results["methods"]] == default
    assert results["seeds"] == [1234, 1, 2] and results["iters"] == 300
    assert all(len(m["final_loss_runs"]) == 3 for m in results["methods"])


def test_the_committed_side_by_side_run_is_the_races_and_the_report_says_where_it_goes():
    """benchmarks/results/bench_step_balancers.json is the race's side-by-side run: the race
    writes it into its workdir (not into benchmarks/results), where BALANCE_RACE.md says, and
    its ratios are the table's side-by-side column."""
    committed = json.loads((Path(race.RESULTS) / "bench_step_balancers.json").read_text())
    workdir = Path(race.race_workdir(race.DEFAULT_ARGS_FILE)).relative_to(REPO)
    assert committed["args"]["out"] == str(workdir / "step_balancers.json")
    assert committed["args"]["steps"] == 60  # the race's --side-by-side-steps default
    table = json.loads((Path(race.RESULTS) / "training_balance.json").read_text())["methods"]
    for row in table:
        if row["method"] in committed["results"]:
            paired = committed["results"][row["method"]]["ratio_vs_none_paired"]
            assert row["tokens_per_s_rel_side_by_side"] == paired
    report = " ".join((REPO / "benchmarks" / "BALANCE_RACE.md").read_text().split())
    assert (
        f"the race writes it to its workdir, `{workdir / 'step_balancers.json'}`, committed as "
        "`benchmarks/results/bench_step_balancers.json`" in report
    )


def test_other_args_files_write_beside_the_races_results():
    """The race of another model never replaces the headline training_balance.json."""
    assert race.results_dir(race.DEFAULT_ARGS_FILE) == race.RESULTS
    wide = str(REPO / "examples" / "args" / "k3_sparse_wide.sh")
    assert race.results_dir(wide) == str(Path(race.RESULTS) / "k3_sparse_wide")
    assert race.race_workdir(wide) == str(REPO / "runs" / "training_balance" / "k3_sparse_wide")


def test_the_race_trains_the_args_files_model_with_the_seed_asked(tmp_path):
    """The last occurrence of a flag wins (an args file that sources another and overrides it);
    seed 0 is a seed."""
    tiny = race.model_shape(race.DEFAULT_ARGS_FILE)
    assert tiny[:2] == (128, 4)
    args_file = tmp_path / "model.sh"
    args_file.write_text(f'source "{race.DEFAULT_ARGS_FILE}"\nARGS+=(--num-experts 16)\n')
    assert race.model_shape(str(args_file)) == (16, *tiny[1:])
    args = SimpleNamespace(args_file=str(args_file), iters=60)
    cmd = race.race_command(["--x"], args, "r.jsonl", seed=0)
    assert cmd[-3:] == ["--x", "--seed", "0"] and "--seed" not in race.race_command([], args, "r")


@pytest.fixture
def instant_race(monkeypatch):
    """The race with runs that train instantly (``tokens_per_s``: a method's figure, 1000 by
    default), no token floor and no picture; ``trained``: the runs trained."""
    race_ = SimpleNamespace(trained=[], tokens_per_s={})

    def fake_run(name, flags, args, jsonl, seed=None):
        race_.trained.append(name)
        speed = race_.tokens_per_s.get(name, 1000.0)
        with open(jsonl, "w") as f:
            for r in _records([1.0] * args.iters, tokens_per_s=speed):
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
    return race_


def test_a_finished_run_is_reused_only_with_the_flags_that_trained_it(
    tmp_path, monkeypatch, capsys, instant_race
):
    """The race reused any JSONL with enough iterations: after a method's flags, the args file,
    --iters or the seed changed, it reported the old run as the new one."""
    args_file = tmp_path / "model.sh"
    args_file.write_text(
        'source "%s"\nARGS+=(--lr 1e-3)\n' % (REPO / "examples" / "args" / "k3_sparse_tiny.sh")
    )
    trained = instant_race.trained
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
    (tmp_path / "runs" / "none.cmd.json").write_text("[")  # a record cut short
    assert race_with() == ["none"]
    assert "no record of the flags" in capsys.readouterr().out
    jsonl = tmp_path / "runs" / "none.jsonl"
    jsonl.write_text("".join(jsonl.read_text().splitlines(keepends=True)[:-1]))  # killed at 59
    assert race_with() == ["none"]
    assert "not run to the end" in capsys.readouterr().out


def test_tokens_per_s_relative_to_none_and_side_by_side_without_partial_rescoring(
    tmp_path, monkeypatch, instant_race
):
    """tokens/s of the runs is relative to ``none``'s; the side-by-side bench is asked only for
    methods that rescore every iteration or none (a 1-50 window would mix two step costs)."""
    window = "QB centered + seq_aux_loss + rescore 1-50 (ours)"
    every = "QB centered + rescore (ours)"
    instant_race.tokens_per_s.update({"aux_loss": 800.0, every: 500.0, window: 400.0})
    asked = []

    def side_by_side(args, methods):
        asked.append(methods)
        return {
            m: dict(
                ratio_vs_none_paired=0.9,
                ratio_vs_none_paired_ci95=[0.8, 1.0],
                router_s_median=0.1,
                step_s_median=0.4,
            )
            for m in methods
        }

    monkeypatch.setattr(race, "side_by_side_tokens_per_s", side_by_side)
    methods = ["none", "aux_loss", every, window]
    race.main(
        ["--methods", *methods, "--iters", "60", "--side-by-side-steps", "3"]
        + ["--workdir", str(tmp_path / "runs"), "--out", str(tmp_path / "out")]
    )
    assert asked == [methods[:3]]
    rows = json.loads((tmp_path / "out" / "training_balance.json").read_text())["methods"]
    assert [r["tokens_per_s_rel"] for r in rows] == [1.0, 0.8, 0.5, 0.4]
    assert [r.get("router_share_side_by_side") for r in rows] == [0.25, 0.25, 0.25, None]


def test_side_by_side_is_reused_only_for_the_same_methods_steps_and_model(tmp_path, monkeypatch):
    calls = []

    def fake_bench(cmd, **kwargs):  # bench_step_balancers.py: its JSON, numbered by call
        calls.append(cmd)
        value = lambda flag: cmd[cmd.index(flag) + 1]  # noqa: E731
        methods = cmd[cmd.index("--methods") + 1 :]
        args = dict(methods=methods, steps=int(value("--steps")), args_file=value("--args-file"))
        results = {m: len(calls) for m in methods}
        Path(value("--out")).write_text(json.dumps(dict(args=args, results=results)))

    monkeypatch.setattr(race.subprocess, "run", fake_bench)
    args = SimpleNamespace(
        workdir=str(tmp_path), side_by_side_steps=3, args_file=race.DEFAULT_ARGS_FILE, fresh=False
    )
    assert race.side_by_side_tokens_per_s(args, ["none"]) == {"none": 1}
    assert race.side_by_side_tokens_per_s(args, ["none"]) == {"none": 1}  # reused
    assert race.side_by_side_tokens_per_s(args, ["none", "aux_loss"])["none"] == 2
    args.side_by_side_steps = 4
    assert race.side_by_side_tokens_per_s(args, ["none", "aux_loss"])["none"] == 3
    args.fresh = True
    assert race.side_by_side_tokens_per_s(args, ["none", "aux_loss"])["none"] == 4


def test_a_failed_run_leaves_no_record_and_no_stale_result(tmp_path, monkeypatch):
    """A run's flags are recorded only once it finished; the previous run's JSONL and record go
    before it starts (a failed re-run must not leave the old run to be reused)."""
    real_run = subprocess.run
    exit_code = [3]

    def fake_training(cmd, **kwargs):
        if not cmd[1].endswith("run_torchrun.sh"):
            return real_run(cmd, **kwargs)  # the args file's flags
        assert not (tmp_path / "m.jsonl").exists() and not (tmp_path / "m.cmd.json").exists()
        kwargs["stdout"].write("training log\n")
        return subprocess.CompletedProcess(cmd, exit_code[0])

    monkeypatch.setattr(race.subprocess, "run", fake_training)
    args = SimpleNamespace(args_file=race.DEFAULT_ARGS_FILE, iters=60)
    jsonl = str(tmp_path / "m.jsonl")
    for stale in ("m.jsonl", "m.cmd.json"):
        (tmp_path / stale).write_text("[]")
    with pytest.raises(RuntimeError, match=r"(?s)^m: exit 3; log .*m\.log:\ntraining log\n$"):
        race.run_method("m", ["--x"], args, jsonl)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.log"]
    exit_code[0] = 0
    race.run_method("m", ["--x"], args, jsonl)
    record = race.run_record(race.race_command(["--x"], args, jsonl))
    assert json.loads((tmp_path / "m.cmd.json").read_text()) == record and record[-1] == "--x"


def test_corpus_tokens_are_every_document_in_order_as_int64(monkeypatch):
    import numpy as np
    from megatron.core.datasets import indexed_dataset

    from megatron_latentmoe.data import corpus

    docs = [np.array([5, 6], dtype=np.uint16), np.array([7], dtype=np.uint16), np.array([8, 9])]
    monkeypatch.setattr(corpus, "prepare_default_dataset", lambda: "the prefix")
    monkeypatch.setattr(indexed_dataset, "IndexedDataset", lambda prefix: docs)
    tokens = race.corpus_tokens()
    assert tokens.tolist() == [5, 6, 7, 8, 9] and tokens.dtype == np.int64


def test_token_floor_is_the_most_frequent_tokens_share_times_n_over_k(monkeypatch):
    """MaxVio >= f·n/k - 1 for a token with share f of the batch, never below 0; mean and max
    over the batches, and the token that most often sets it (decoded)."""
    import numpy as np
    from tokenizers import Tokenizer

    from megatron_latentmoe.data.corpus import default_tokenizer_dir

    vocab = Tokenizer.from_file(str(Path(default_tokenizer_dir()) / "tokenizer.json"))
    corpus = [np.full(100, 7)]
    monkeypatch.setattr(race, "corpus_tokens", lambda: corpus[0])
    one_token = race.token_floor(8, 2, seq_length=4, global_batch=3, batches=5)
    assert one_token == dict(
        mean=3.0, max=3.0, experts_over_topk=4.0, most_frequent_token=vocab.decode([7])
    )
    corpus[0] = np.arange(1000)  # every token once per window: f = 1/8, 1/8·4/2 - 1 < 0
    assert race.token_floor(4, 2, seq_length=4, global_batch=2, batches=5)["max"] == 0.0
    # 7 sets most batches' floor, 9 some; their floors vary from batch to batch
    corpus[0] = np.random.default_rng(5).choice([7, 9, 11], size=300, p=[0.6, 0.3, 0.1])
    mixed = race.token_floor(8, 2, seq_length=4, global_batch=1, batches=40)
    assert mixed["max"] == 3.0 and 0 < mixed["mean"] < 3.0
    assert mixed["most_frequent_token"] == vocab.decode([7]) != vocab.decode([9])
    assert race.token_floor(8, 2, seq_length=4, global_batch=1, batches=40) == mixed  # seeded
    assert race.token_floor(8, 2, 4, 1, batches=40, seed=1)["mean"] != mixed["mean"]
