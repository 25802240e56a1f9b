"""benchmarks/bench_balance_floor.py: the floor table's figures (mean, worst, share of batches at
or under the target; 'previous' has no batch 1), the balancing bias it solves, and the flags'
errors (``--load`` routes at one run's weights, so one seed)."""

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_latentmoe.balancing_reference import exact_quantile_bias

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location(
    "bench_balance_floor", REPO / "benchmarks" / "bench_balance_floor.py"
)
floor = importlib.util.module_from_spec(spec)
spec.loader.exec_module(floor)


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
