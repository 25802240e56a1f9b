"""benchmarks/bench_balance_floor.py: the floor table's figures (mean, worst, share of batches at
or under the target; 'previous' has no batch 1), the balancing bias it solves, and the flags'
errors (``--load`` routes at one run's weights, so one seed)."""

import importlib.util
from pathlib import Path

import pytest
import torch

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


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--ckpt-step", "150"], "--ckpt-step 150: allowed only with --load"),
        (["--load", "/no/such/dir"], "--load /no/such/dir: not a folder"),
        (["--load", "{tmp}", "--seeds", "1", "2"], "--load with --seeds 1 2: allowed: the run's"),
    ],
)
def test_flag_errors_name_flag_and_value(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        floor.parse_args([w.format(tmp=tmp_path) for w in argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
