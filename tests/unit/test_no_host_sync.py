"""The project standard "no host syncs in the forward; router math and buffers in fp32; no Python
loop over tokens in a hot path", tested.

The training forward of the router (every balancer the README lists), of the Stable LatentMoE
block (local path, both dispatchers), of the QB histogram's per-micro-batch accumulation and of
``training.forward_step`` issues no operation that makes a CUDA device wait for the host from our
code (``host_sync.py`` records them, with the frame that issued each one). megatron-core's own
(its dispatchers' split sizes) are Megatron's: listed, printed, not ours to remove. The step end
(after the backward) reads the host once for all layers. In a bf16 block the router's logits,
scores and buffers stay fp32. The Python lines our code runs do not grow with the tokens.
"""

from __future__ import annotations

import collections
import os
import sys

import pytest
import torch

from tests.parallel.launcher import run_distributed
from tests.unit.test_balance_routers import BALANCERS as RECOUNTED

SEQ, BATCH, HIDDEN = 12, 4, 64
# every balancer the README lists ("Load balance"): test_balance_routers' table (Megatron's,
# Megatron's own QB, ours), the QB absorption loss and sinkhorn
BALANCERS = {
    **{k: v for k, v in RECOUNTED.items() if k != "aux_loss_capacity_padded"},
    "qb_absorb": dict(moe_qb_absorb_coeff=0.3),
    "sinkhorn": dict(moe_router_load_balancing_type="sinkhorn"),
}
DISPATCHERS = ("alltoall", "allgather")


# Megatron's code that moves a CPU router weight "to the GPU" (``TopKRouter.gating``): on a CPU
# run only, never on CUDA (the weight is already there)
CPU_RUN_ONLY = ("megatron/core/transformer/moe/router.py:98 (gating)",)


def _megatron(recorder) -> list[str]:
    return [s for s in recorder.megatron() if not any(site in s for site in CPU_RUN_ONLY)]


def _host_tensors(model) -> list:
    """megatron-core's alltoall dispatcher keeps its chunk orders on the host (``cpu`` unless
    ``moe_permute_fusion``), in a CUDA run too: reading them is no sync."""
    out = []
    for module in model.modules():
        dispatcher = getattr(module, "token_dispatcher", None)
        for name in ("sort_input_by_local_experts", "restore_output_by_local_experts"):
            if getattr(dispatcher, name, None) is not None:
                out.append(getattr(dispatcher, name))
    return out


def _padding(name):
    if name == "megatron_qb":  # Megatron's own QB cannot take a padding mask (refused)
        return None
    padding = torch.zeros(BATCH, SEQ, dtype=torch.bool)
    padding[:, -3:] = True
    return padding


def _layer(overrides, **extra):
    from megatron_latentmoe.config import tiny_config
    from megatron_latentmoe.specs import get_stable_latentmoe_mlp_spec

    cfg = tiny_config(**overrides, **extra)
    layer = get_stable_latentmoe_mlp_spec(cfg)(config=cfg, layer_number=1)
    layer.train()
    return layer, cfg


def _blocks(rank, world_size):
    """Per balancer and dispatcher: the syncs of the router's and the block's training forward,
    of the backward, and of the step end."""
    from megatron_latentmoe.compat import initialize_parallel_cpu
    from megatron_latentmoe.moe.balance_step import update_balance
    from megatron_latentmoe.ops.situ import set_cpu_compile
    from tests.unit.host_sync import SyncRecorder, as_on_cuda

    set_cpu_compile(False)
    initialize_parallel_cpu()
    out = {}
    with as_on_cuda():
        for dispatcher in DISPATCHERS:
            for name, overrides in BALANCERS.items():
                torch.manual_seed(0)
                layer, _ = _layer(overrides, moe_token_dispatcher_type=dispatcher)
                padding = _padding(name)
                x = torch.randn(SEQ, BATCH, HIDDEN, requires_grad=True)
                with SyncRecorder() as router:
                    layer.router(x, padding_mask=padding)
                with SyncRecorder(_host_tensors(layer)) as block:
                    y, _ = layer(x, padding_mask=padding)
                with SyncRecorder() as backward:
                    y.float().sum().backward()
                out[(dispatcher, name)] = {
                    part: (rec.ours(), _megatron(rec))
                    for part, rec in (("router", router), ("block", block), ("backward", backward))
                }
                with SyncRecorder() as step_end:
                    update_balance([layer])
                out[(dispatcher, name)]["step_end"] = (step_end.ours_all(), _megatron(step_end))
    return out


@pytest.fixture(scope="module")
def blocks():
    (result,) = run_distributed(_blocks, 1)
    return result


@pytest.mark.parametrize("dispatcher", DISPATCHERS)
@pytest.mark.parametrize("name", list(BALANCERS))
def test_training_forward_of_router_and_block_issues_no_host_sync_of_ours(blocks, dispatcher, name):
    result = blocks[(dispatcher, name)]
    for part in ("router", "block"):
        ours, megatron = result[part]
        print(f"{name} {dispatcher} {part}: Megatron's syncs: {megatron}")
        assert ours == [], f"{part} forward: {ours}"
    ours, megatron = result["backward"]
    print(f"{name} {dispatcher} backward: Megatron's syncs: {megatron}")
    assert ours == [], f"backward: {ours}"


def _one_step_end_read(step_end) -> bool:
    """The step end's syncs: ONE host read (``balance_step._read_once``), none of Megatron's."""
    ours, megatron = step_end
    return (
        len(ours) == 1
        and ours[0].startswith("ours: tolist at megatron_latentmoe/moe/balance_step.py:")
        and ours[0].endswith("(_read_once)")
        and megatron == []
    )


@pytest.mark.parametrize("dispatcher", DISPATCHERS)
@pytest.mark.parametrize("name", list(BALANCERS))
def test_step_end_reads_the_host_once(blocks, dispatcher, name):
    """``update_balance`` after the backward: one host read (metrics and QB's checks together)."""
    assert _one_step_end_read(blocks[(dispatcher, name)]["step_end"]), blocks[(dispatcher, name)]


def test_qb_histogram_accumulates_micro_batches_without_a_host_sync():
    """``observe`` per micro-batch, both binnings, with and without a padding mask and the
    router's cutoffs (its overflow guard reads the host only near 2**31 tokens)."""
    from megatron_latentmoe.balancing import (
        CenteredQuantileHistogram,
        QuantileHistogram,
        cutoff_route,
    )
    from tests.unit.host_sync import SyncRecorder

    out = {}
    g = torch.Generator().manual_seed(0)
    n, k, m = 16, 3, 64
    for cls in (QuantileHistogram, CenteredQuantileHistogram):
        for masked in (False, True):
            for given_alpha in (False, True):
                hist = cls(n, k, num_bins=64)
                bias = 0.1 * torch.randn(n, generator=g)
                with SyncRecorder() as rec:
                    for _ in range(3):  # the micro-batches of one step
                        scores = torch.rand(m, n, generator=g)
                        valid = torch.rand(m, generator=g) > 0.2 if masked else None
                        alpha = cutoff_route(scores, bias, k)[1] if given_alpha else None
                        hist.observe(scores, bias, valid_M=valid, alpha_M=alpha)
                out[(cls.__name__, masked, given_alpha)] = rec.ours_all()
                assert int(hist.num_tokens) > 0
    assert len(out) == 8
    assert all(ours == [] for ours in out.values()), out


VOCAB = 128


def _forward_steps(rank, world_size):
    """``training.forward_step`` (batch, model forward, loss function) on a 2-layer GPT model
    (dense + Stable LatentMoE), with and without loss-masked tokens."""
    import types
    from unittest import mock

    from megatron_latentmoe.compat import apply_python311_compat, initialize_parallel_cpu
    from megatron_latentmoe.config import tiny_config
    from megatron_latentmoe.data.index_file import Vocabulary
    from megatron_latentmoe.model import build_gpt_model
    from megatron_latentmoe.moe.balance_step import update_balance
    from megatron_latentmoe.ops.situ import set_cpu_compile
    from megatron_latentmoe.training import forward_step as fs
    from megatron_latentmoe.training.balance_logging import BalanceLogger
    from tests.unit.host_sync import SyncRecorder, as_on_cuda, batches_to_device

    apply_python311_compat()
    import megatron.training

    set_cpu_compile(False)
    initialize_parallel_cpu()
    timer = types.SimpleNamespace(start=lambda **kw: None, stop=lambda **kw: None)
    args = types.SimpleNamespace(check_for_nan_in_loss_and_grad=False, rerun_mode="disabled")
    # every batch's largest token id is checked against the vocabulary, as in a run
    fs.set_vocabulary(Vocabulary(VOCAB, VOCAB, "the test's", "-"))
    out = {}
    for dispatcher in DISPATCHERS:
        for name in ("qb_centered", "aux_loss", "megatron_qb"):
            torch.manual_seed(0)
            cfg = tiny_config(
                **BALANCERS[name],
                num_layers=3,  # dense + 2 Stable LatentMoE layers
                first_k_dense_replace=1,
                moe_token_dispatcher_type=dispatcher,
            )
            model = build_gpt_model(cfg, vocab_size=VOCAB, max_sequence_length=SEQ)
            model.train()
            fs.set_balance_logger(
                BalanceLogger(
                    num_layers=3, num_experts=8, tokens_per_step=SEQ, iteration_fn=lambda: 1
                )
            )
            for masked in (False, True) if name != "megatron_qb" else (False,):
                tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1))
                loss_mask = torch.ones(BATCH, SEQ)
                if masked:
                    loss_mask[:, -2:] = 0
                batch = {  # the loader's host tensors, as Megatron's GPTDataset gives them
                    "tokens": tokens[:, :-1].contiguous(),
                    "labels": tokens[:, 1:].contiguous(),
                    "loss_mask": loss_mask,
                    "position_ids": torch.arange(SEQ).repeat(BATCH, 1),
                }
                with (
                    mock.patch.object(megatron.training, "get_args", lambda: args),
                    mock.patch.object(
                        megatron.training, "get_timers", lambda: lambda *a, **k: timer
                    ),
                    as_on_cuda(),
                    batches_to_device(),
                    SyncRecorder([*batch.values(), *_host_tensors(model)]) as rec,
                ):
                    output, loss_func = fs.forward_step(iter([batch]), model)
                    loss, num_tokens, report = loss_func(output)
                with SyncRecorder() as backward:
                    loss.backward()
                with SyncRecorder() as step_end:
                    metrics = update_balance([model])
                out[(dispatcher, name, masked)] = dict(
                    forward=(rec.ours(), _megatron(rec)),
                    backward=(backward.ours(), _megatron(backward)),
                    step_end=(step_end.ours_all(), _megatron(step_end)),
                    layers=len(metrics),
                    num_tokens=int(num_tokens),
                )
            fs.set_balance_logger(None)
    fs.set_vocabulary(None)
    return out


def test_forward_step_reads_only_the_loaders_host_batch():
    """The only host reads of ``forward_step`` are whether the loader's (host) loss mask masks
    any token and the largest token id of its (host) tokens and labels: no device sync."""
    (result,) = run_distributed(_forward_steps, 1)
    assert len(result) == 10
    for (dispatcher, name, masked), r in result.items():
        assert r["num_tokens"] == BATCH * (SEQ - 2 if masked else SEQ)
        print(f"forward_step {name} {dispatcher} masked={masked}: Megatron's {r['forward'][1]}")
        assert r["forward"][0] == [], (dispatcher, name, masked, r["forward"][0])
        assert r["backward"][0] == [], (dispatcher, name, masked, r["backward"][0])
        # the step end after it: one host read for both MoE layers, whatever the balancer
        assert r["layers"] == 2
        assert _one_step_end_read(r["step_end"]), r["step_end"]


FP32_CASES = ("qb_uniform", "qb_centered", "qb_seq_aux_loss", "aux_loss", "sign_update")


def _bf16_routers(rank, world_size):
    """A bf16 block (config and a ``.bfloat16()`` cast, as Megatron's ``Float16Module``): the
    dtypes of the router's logits, of the scores QB observes, of the histogram's window state
    and of the router's floating buffers, before and after a step end."""
    from megatron_latentmoe.compat import initialize_parallel_cpu
    from megatron_latentmoe.moe.balance_step import update_balance

    initialize_parallel_cpu()
    out = {}
    for name in FP32_CASES:
        torch.manual_seed(0)
        layer, _ = _layer(BALANCERS[name], bf16=True, params_dtype=torch.bfloat16)
        layer = layer.bfloat16()
        router = layer.router
        seen = {}
        routing = router.routing

        def spy_routing(logits, *args, seen=seen, routing=routing, **kwargs):
            seen.setdefault("logits", set()).add(logits.dtype)
            probs, routing_map = routing(logits, *args, **kwargs)
            seen.setdefault("probs", set()).add(probs.dtype)
            return probs, routing_map

        router.routing = spy_routing
        hist = getattr(router, "qb_histogram", None)
        if hist is not None:
            observe = hist.observe

            def spy_observe(scores, bias, *args, seen=seen, observe=observe, **kwargs):
                seen.setdefault("scores", set()).add(scores.dtype)
                seen.setdefault("bias", set()).add(bias.dtype)
                observe(scores, bias, *args, **kwargs)

            hist.observe = spy_observe
        x = torch.randn(SEQ, BATCH, HIDDEN).bfloat16().requires_grad_()
        y, _ = layer(x, padding_mask=_padding(name))
        y.float().sum().backward()
        buffers = {n: b.dtype for n, b in router.named_buffers() if b.is_floating_point()}
        if hist is not None:
            seen["window"] = {hist._bias_E.dtype} | {t.dtype for t in hist._range}
        update_balance([layer])
        after = {n: b.dtype for n, b in router.named_buffers() if b.is_floating_point()}
        out[name] = dict(
            seen=seen, buffers=buffers, after=after, output=y.dtype, weight=router.weight.dtype
        )
    return out


def test_router_math_and_buffers_stay_fp32_in_a_bf16_block():
    (result,) = run_distributed(_bf16_routers, 1)
    for name in FP32_CASES:
        r = result[name]
        assert r["output"] == r["weight"] == torch.bfloat16, name  # the block does run in bf16
        assert r["seen"]["logits"] == {torch.float32}, (name, r["seen"])
        assert set(r["buffers"].values()) <= {torch.float32}, (name, r)
        assert r["after"] == r["buffers"], (name, r)
        if name.startswith("qb"):
            for key in ("scores", "bias", "window"):
                assert r["seen"][key] == {torch.float32}, (name, key, r["seen"])
            assert {"expert_bias", "step_input_sum_D", "qb_mean_input"} <= set(r["buffers"])
        if name == "sign_update":
            assert {"expert_bias", "local_tokens_per_expert"} <= set(r["buffers"])


def _python_lines(rank, world_size):
    """Python lines run in ``megatron_latentmoe/`` by a block's training forward + backward + step
    end, at 1x and 8x the tokens."""
    import megatron_latentmoe.compat.cpu
    from megatron_latentmoe.compat import initialize_parallel_cpu
    from megatron_latentmoe.moe.balance_step import update_balance
    from megatron_latentmoe.ops.situ import set_cpu_compile

    set_cpu_compile(False)
    initialize_parallel_cpu()
    package = os.sep + "megatron_latentmoe" + os.sep
    cpu_shim = os.path.abspath(megatron_latentmoe.compat.cpu.__file__)
    out = {}
    for name in ("qb_centered", "qb_absorb", "aux_loss", "sign_update"):
        for dispatcher in DISPATCHERS:
            counts = []
            for tokens in (SEQ, 8 * SEQ):
                torch.manual_seed(0)
                layer, _ = _layer(BALANCERS[name], moe_token_dispatcher_type=dispatcher)
                x = torch.randn(tokens, BATCH, HIDDEN, requires_grad=True)
                padding = torch.zeros(BATCH, tokens, dtype=torch.bool)
                padding[:, -1] = True
                lines = collections.Counter()

                def trace(frame, event, arg, lines=lines):
                    path = frame.f_code.co_filename
                    if package not in path or path == cpu_shim:  # the CPU run's torch shim
                        return None
                    if event == "line":
                        lines[frame.f_code.co_filename] += 1
                    return trace

                sys.settrace(trace)
                try:
                    y, _ = layer(x, padding_mask=padding)
                    y.sum().backward()
                    update_balance([layer])
                finally:
                    sys.settrace(None)
                counts.append(dict(lines))
            out[(name, dispatcher)] = counts
    return out


def test_no_python_loop_over_tokens():
    """A loop over tokens in our hot path runs more lines with more tokens: the block's forward,
    backward and step end run the same number of lines at 48 and 384 tokens (torch's autograd
    runs our backward functions from C++: ``settrace`` sees them too)."""
    (result,) = run_distributed(_python_lines, 1)
    for key, (small, large) in result.items():
        assert sum(small.values()) > 100, (key, small)
        assert small == large, (key, small, large)


def test_hf_moe_forward_reads_the_host_once_per_moe_layer():
    """The HF remote code's MoE block loops over the experts hit, as HF MoE code does: one host
    read of the group bounds per MoE layer (``torch.bincount`` there read the expert ids' min and
    max on the host too, on CUDA)."""
    from megatron_latentmoe.hf.modeling_stable_latentmoe import StableLatentMoEForCausalLM
    from tests.unit.host_sync import SyncRecorder
    from tests.unit.test_hf_modeling import tiny_config

    cfg = tiny_config()
    torch.manual_seed(0)
    model = StableLatentMoEForCausalLM(cfg).eval()
    moe_layers = len(model.model.moe_blocks())
    assert moe_layers >= 2
    ids = torch.randint(0, cfg.vocab_size, (2, 6))
    with SyncRecorder() as rec, torch.no_grad():
        model(ids)
    reads = rec.ours_all()
    assert len(reads) == moe_layers, reads
    assert all("modeling_stable_latentmoe.py" in r and r.endswith("(moe_infer)") for r in reads)
