"""benchmarks/bench_balance_floor.py: the floor table's figures (mean, worst, share of batches at
or under the target; 'previous' has no batch 1), the balancing bias it solves, and the flags'
errors (``--load`` routes at one run's weights, so one seed)."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from benchmarks import bench_balance_floor as floor
from megatron_latentmoe.balancing_reference import exact_quantile_bias


def test_summary_of_batches_over_seeds():
    # per batch: [MaxVio of each MoE layer]; a batch's figure is the mean over its layers
    per_seed = {
        "1": {"none": [[2.0, 4.0], [1.0, 1.0]], "previous": [[9.0, 9.0], [0.5, 1.5]]},
        "2": {"none": [[0.5, 0.5], [1.5, 0.7]], "previous": [[9.0, 9.0], [0.2, 0.4]]},
    }
    rows = floor.summarize(per_seed, ["none", "previous"])
    none, previous = rows["none"], rows["previous"]
    assert none["mean"] == pytest.approx((3.0 + 1.0 + 0.5 + 1.1) / 4)
    assert none["worst"] == 3.0
    assert none["at_or_under_target"] == 0.5  # 1.0 itself meets the target
    assert none["batch_1"] == {"1": 3.0, "2": 0.5}
    # batch 1 has no previous batch: its 9.0 is left out
    assert (previous["worst"], previous["at_or_under_target"]) == (1.0, 1.0)
    assert previous["batch_1"] == {"1": None, "2": None}


def test_balancing_bias_balances_the_tokens_it_is_solved_on():
    g = torch.Generator().manual_seed(0)
    scores = torch.sigmoid(torch.randn(2048, 16, generator=g) + torch.linspace(-2, 2, 16))
    unbiased = floor.max_vio(floor.loads_of(scores, torch.zeros(16), 2))
    bias, vio = floor.balancing_bias(scores, 2, iters=40)
    assert unbiased > 2.0
    assert vio == pytest.approx(floor.max_vio(floor.loads_of(scores, bias, 2)))
    assert vio < 0.05
    # one damped step: half-way to the exact QB update from b = 0 (it improves on no bias)
    exact = exact_quantile_bias(scores, torch.zeros(16), 2)
    one_step, one_vio = floor.balancing_bias(scores, 2, iters=1)
    assert torch.allclose(one_step, 0.5 * exact) and one_vio < unbiased


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--ckpt-step", "150"], "--ckpt-step 150: allowed only with --load"),
        (["--load", "/no/such/dir"], "--load /no/such/dir: not a folder"),
        (["--load", "{tmp}", "--seeds", "1", "2"], "--load with --seeds 1 2: allowed: the run's"),
        (["--batches", "1"], "--batches 1: must be >= 2"),
        (["--solver-iters", "1"], "--solver-iters 1: must be >= 2"),
        (["--global-batch-size", "3"], "--global-batch-size 3: allowed: a positive multiple of"),
        (["--global-batch-size", "0"], "--global-batch-size 0: allowed: a positive multiple of"),
        (["--global-batch-size", "4", "--nproc", "0"], "--nproc 0: an integer >= 1"),
    ],
)
def test_flag_errors_name_flag_and_value(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        floor.parse_args([w.format(tmp=tmp_path) for w in argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_defaults_and_one_run_to_load(tmp_path):
    import bench_training_balance as race  # on the path the benchmark puts it on

    a = floor.parse_args([])
    assert a.out == str(Path(race.RESULTS) / "balance_floor.json")
    assert a.race_dir == race.race_workdir(race.DEFAULT_ARGS_FILE) and a.load is None
    a = floor.parse_args(["--load", str(tmp_path), "--out", str(tmp_path), "--nproc", "4"])
    assert (a.load, a.seeds, a.out) == (str(tmp_path), [1234], str(tmp_path / "balance_floor.json"))
    assert floor.parse_args(["--global-batch-size", "12", "--nproc", "4"]).global_batch_size == 12


def test_batch_1_is_checked_against_the_races_none_run(tmp_path):
    """The race names its runs with ``_slug``; batch 1 is compared with iteration 1 of the same
    seed's ``none`` run, never at other weights or another batch size."""
    import bench_training_balance as race

    def parsed(*argv):
        a = floor.parse_args(["--race-dir", str(tmp_path), *argv])
        a.seed = 7
        return a

    assert floor.race_iteration_1(parsed()) is None  # the race has not run
    loads = [[3, 1], [2, 2]]
    lines = [dict(iteration=i, layers=[dict(loads=[i, i]) for _ in loads]) for i in (1, 2)]
    lines[0]["layers"] = [dict(loads=layer) for layer in loads]
    (tmp_path / (race._slug("none seed 7") + ".jsonl")).write_text(
        "".join(json.dumps(line) + "\n" for line in lines)
    )
    assert floor.race_iteration_1(parsed()) == loads
    assert floor.race_iteration_1(parsed("--global-batch-size", "4")) is None
    assert floor.race_iteration_1(parsed("--load", str(tmp_path))) is None
    # a race without --seeds (its default command) names the run "none" and trains it with the
    # args file's seed: the last --seed of the flags it recorded
    (tmp_path / "none_seed_7.jsonl").rename(tmp_path / "none.jsonl")
    assert floor.race_iteration_1(parsed()) is None  # no record of its flags
    for seed, expected in (("7", loads), ("8", None)):
        (tmp_path / "none.cmd.json").write_text(json.dumps(["--seed", "1", "--seed", seed]))
        assert floor.race_iteration_1(parsed()) == expected


def _variants(g0, g1, pooled=None):
    """Batches 0 and 1 at one MoE layer through ``Floors._variant_bias``, per variant: (bias of
    each batch, MaxVio recorded, loads of batch 1)."""
    floors = floor.Floors.__new__(floor.Floors)
    floors.a, floors.topk = SimpleNamespace(solver_iters=20), 2
    out = {}
    for name in ("none", "own", "previous", "pooled"):
        zeros = torch.zeros(g0.shape[1])
        state = dict(zeros=zeros, previous=[zeros], vios=None, loads_1=[])
        biases, vios = [], []
        for t, g in enumerate((g0, g1)):
            state["vios"] = [None]
            biases.append(floors._variant_bias(name, t, pooled, state, 0, g))
            vios.append(state["vios"][0])
        out[name] = (biases, vios, state["loads_1"])
    return out


def test_each_variant_routes_a_batch_with_the_bias_it_may_know():
    """'previous' routes batch t with batch t-1's bias, 'pooled' with the other parity's: never
    with a bias solved on the batch itself (what only 'own' may use)."""
    g = torch.Generator().manual_seed(1)
    g0, g1 = (
        torch.sigmoid(torch.randn(512, 8, generator=g) + torch.linspace(-2, 2, 8)) for _ in "ab"
    )
    pooled = [[torch.full((8,), 0.5)], [torch.full((8,), -0.5)]]
    out = _variants(g0, g1, pooled)
    own_0, own_1 = (floor.balancing_bias(s, 2, 20)[0] for s in (g0, g1))
    assert torch.equal(out["own"][0][1], own_1)
    assert torch.equal(out["previous"][0][0], torch.zeros(8))
    assert torch.equal(out["previous"][0][1], own_0)
    assert [b[0].item() for b in out["pooled"][0]] == [-0.5, 0.5]  # even from odd, odd from even
    assert out["previous"][1][1] == floor.max_vio(floor.loads_of(g1, own_0, 2))
    none_loads = floor.loads_of(g0, torch.zeros(8), 2)
    assert out["none"][2] == [none_loads.tolist()] and sum(none_loads.tolist()) == 2 * 512


def test_loads_count_every_expert_also_an_idle_one():
    scores = torch.tensor([[0.9, 0.8, 0.1], [0.7, 0.9, 0.2]])
    loads = floor.loads_of(scores, torch.zeros(3), 2)
    assert loads.tolist() == [2, 2, 0]
    assert floor.max_vio(loads) == pytest.approx(0.5)  # (2 - 4/3) / (4/3)


def test_pooled_bias_layers_before_route_with_their_bias():
    """Solving layer 1: layer 0 routes with its solved bias, layer 1 adds its scores to the pool
    and routes without a bias, as does layer 2."""
    solved, pool = [torch.full((4,), 0.5)], []
    g = [torch.rand(6, 4) for _ in range(3)]
    biases = [floor._pool_bias(solved, 1, pool, i, g[i]) for i in range(3)]
    assert [b.tolist() for b in biases] == [[0.5] * 4, [0.0] * 4, [0.0] * 4]
    assert len(pool) == 1 and pool[0] is g[1]


def test_global_scores_are_every_ranks_sigmoid_scores_without_padding(monkeypatch):
    """Rank 0's tokens then rank 1's, fp32 sigmoid of the logits, padded tokens dropped."""
    floors = floor.Floors.__new__(floor.Floors)
    floors.world, floors.group = 2, None
    logits = torch.tensor([[[0.0, 1.0]], [[2.0, -1.0]], [[-3.0, 0.5]]], dtype=torch.bfloat16)
    padding = torch.tensor([[False], [True], [False]])  # [seq, batch]: token 1 is padding
    rank_1 = torch.tensor([[0.25, 0.75, 1.0], [0.5, 0.5, 0.0], [0.1, 0.9, 1.0]])  # 1: padding

    def all_gather(parts, mine, group=None):
        assert group is None and len(parts) == 2
        parts[0].copy_(mine)
        parts[1].copy_(rank_1)

    monkeypatch.setattr(torch.distributed, "all_gather", all_gather)
    g = floors._global_scores(logits, padding)
    expected = torch.sigmoid(torch.tensor([[0.0, 1.0], [-3.0, 0.5]]))
    assert g.dtype == torch.float32
    torch.testing.assert_close(g, torch.cat([expected, torch.tensor([[0.25, 0.75], [0.1, 0.9]])]))
    unpadded = floors._global_scores(logits, None)  # no mask: every token of this rank counts
    assert unpadded.shape == (5, 2)
    torch.testing.assert_close(unpadded[1], torch.sigmoid(torch.tensor([2.0, -1.0])))


def _built_flags(monkeypatch, *argv):
    """The flags ``build`` checks as the race's entry point would (it stops there)."""
    import bench_step_balancers

    from megatron_latentmoe.compat import apply_python311_compat

    apply_python311_compat()  # as run_rank does before build imports megatron.training

    class Checked(Exception):
        pass

    def checked(flags):
        raise Checked(flags)

    monkeypatch.setattr(bench_step_balancers, "checked", checked)
    a = floor.parse_args(list(argv))
    a.seed = 7
    with pytest.raises(Checked) as got:
        floor.build(a)
    return got.value.args[0]


def _value(flags, name):
    return flags[len(flags) - 1 - flags[::-1].index(name) + 1]  # the last occurrence wins


def test_build_routes_the_races_qb_model_and_data(monkeypatch, tmp_path):
    import bench_training_balance as race

    flags = _built_flags(monkeypatch, "--batches", "20")
    base = race.args_file_flags(race.DEFAULT_ARGS_FILE)
    assert flags[: len(base)] == base  # the args file's model, then the QB method's flags
    assert (
        flags[len(base) : len(base) + len(race.METHODS["QB centered (ours)"])]
        == (race.METHODS["QB centered (ours)"])
    )
    # the race's --iters size Megatron's dataset (its sample order), also for fewer batches
    assert _value(flags, "--train-iters") == "300" and _value(flags, "--seed") == "7"
    assert "--load" not in flags and _value(flags, "--global-batch-size") == _value(
        base, "--global-batch-size"
    )
    flags = _built_flags(monkeypatch, "--batches", "400", "--global-batch-size", "12")
    assert _value(flags, "--train-iters") == "400"
    assert (_value(flags, "--global-batch-size"), _value(flags, "--micro-batch-size")) == (
        "12",
        "6",  # one micro-batch per rank of the 2
    )
    flags = _built_flags(monkeypatch, "--load", str(tmp_path), "--ckpt-step", "150")
    at = flags.index("--load")
    assert flags[at:] == [
        "--load",
        str(tmp_path),
        "--no-load-optim",
        "--no-load-rng",
        "--ckpt-step",
        "150",
    ]


def test_run_rank_writes_each_variants_maxvio_and_the_batch_1_check(monkeypatch, tmp_path):
    import megatron_latentmoe.compat as compat

    for name in ("apply_python311_compat", "apply_core_compat", "apply_cpu_compat"):
        monkeypatch.setattr(compat, name, lambda: None)
    args = SimpleNamespace(global_batch_size=4, seq_length=8)
    monkeypatch.setattr(floor, "build", lambda a: (args, "config", "model", ["b1", "b2"], 150))
    routed = []

    class FakeFloors:
        def __init__(self, a, config, model, batches):
            assert (config, model, batches) == ("config", "model", ["b1", "b2"])

        def pooled_biases(self):
            return "pooled biases"

        def run_variant(self, name, pooled):
            routed.append((name, pooled))
            return [[len(name)], [0.5]], [[1, 3]]

    monkeypatch.setattr(floor, "Floors", FakeFloors)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 0)
    race = [None]
    monkeypatch.setattr(floor, "race_iteration_1", lambda a: race[0])

    def result(*variants):
        part = tmp_path / "r.part"
        a = floor.parse_args(["--variants", *variants])
        a.seed, a.part = 1, str(part)
        routed.clear()
        floor.run_rank(a)
        return json.loads(part.read_text())

    r = result("none", "previous")
    assert routed == [("none", None), ("previous", None)]  # nothing pooled unless asked
    assert (r["tokens_per_batch"], r["loaded_iteration"]) == (32, 150)
    assert r["none"] == [[4], [0.5]] and r["previous"] == [[8], [0.5]]
    assert r["batch_1_loads"] == [[1, 3]] and r["matches_race_iteration_1"] is None
    race[0] = [[1, 3]]
    assert result("none")["matches_race_iteration_1"] is True
    race[0] = [[2, 2]]
    assert result("none")["matches_race_iteration_1"] is False
    r = result("pooled")
    assert routed == [("pooled", "pooled biases")] and "batch_1_loads" not in r
