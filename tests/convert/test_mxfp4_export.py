"""``convert export --expert-dtype mxfp4``: the routed experts MXFP4-packed (compressed-tensors
``mxfp4-pack-quantized``), everything else as in the plain export; the HF model of that export
computes what the Megatron model computes under MXFP4 QAT; ``import`` reads it back.

One real single-rank ``torch_dist`` checkpoint (the converter tests' model: l = m_e = 32, random
weights) plus one whose m_e = 48 (not a multiple of 32).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from megatron_latentmoe.convert import mxfp4
from megatron_latentmoe.convert.errors import ConversionError
from tests.parallel.launcher import run_distributed

from . import _workers
from .conftest import hf_tensors


def _make(rank, world, out_dir):
    from megatron_latentmoe.compat import initialize_parallel_cpu
    from megatron_latentmoe.convert.arch import ModelArch

    initialize_parallel_cpu(seed=_workers.SEED)
    for name, a in (
        ("ck", _workers.arch("main")),
        (
            "ck48",
            ModelArch(
                **dict(
                    _workers.TEST_ARCH,
                    moe_ffn_hidden_size=48,
                    moe_shared_expert_intermediate_size=96,
                )
            ),
        ),
    ):
        model = _workers._build(a)
        _workers._randomise(model, _workers.SEED)
        if name == "ck":
            torch.save(_workers._full_state(model), os.path.join(out_dir, "full.pt"))
        _workers._save(model, a, os.path.join(out_dir, name))


@pytest.fixture(scope="module", autouse=True)
def _leave_no_megatron_world():
    """``verify`` runs Megatron in this process (a 1-rank gloo world, parallel state, the CPU
    compat mode); take all of it down after this module so later tests start clean."""
    yield
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_latentmoe.compat import revert_cpu_compat

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    revert_cpu_compat()


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    from megatron_latentmoe.convert import export_checkpoint

    root = tmp_path_factory.mktemp("mxfp4")
    run_distributed(_make, 1, str(root), timeout=600)
    out = {"root": root}
    for name, kw in (
        ("hf_mx", dict(expert_dtype="mxfp4")),
        ("hf_fp32", {}),
        ("hf_bf16", dict(dtype="bf16")),
    ):
        out[name] = export_checkpoint(root / "ck", root / name, progress=False, **kw)
    return out


def test_export_writes_packed_experts_and_nothing_else_changes(ws):
    root = ws["root"]
    mx, plain = hf_tensors(root / "hf_mx"), hf_tensors(root / "hf_fp32")
    experts = [k for k in plain if ".block_sparse_moe.experts." in k]
    assert len(experts) == 3 * 8 * 3  # 3 MoE layers x 8 experts x w1, w3, w2
    for k in experts:
        packed, scale = mxfp4.names(k)
        assert mx[packed].dtype == mx[scale].dtype == torch.uint8
        assert mx[packed].shape == (plain[k].shape[0], plain[k].shape[1] // 2)
        assert mx[scale].shape == (plain[k].shape[0], plain[k].shape[1] // 32)
        from megatron_latentmoe.ops.mxfp4 import mxfp4_round_trip

        assert torch.equal(mxfp4.unpack(k, mx, torch.float32), mxfp4_round_trip(plain[k])), k
    rest = set(plain) - set(experts)
    assert set(mx) == rest | {n for k in experts for n in mxfp4.names(k)}
    assert all(torch.equal(mx[k], plain[k]) for k in rest)
    config = json.loads((root / "hf_mx" / "config.json").read_text())
    assert config["quantization_config"] == mxfp4.quantization_config()
    assert "quantization_config" not in json.loads((root / "hf_fp32" / "config.json").read_text())


def test_routed_experts_are_3_76x_smaller_than_bf16(ws):
    mx, bf16 = ws["hf_mx"].extra["routed_expert_bytes"], ws["hf_bf16"].extra["routed_expert_bytes"]
    n = 3 * 8 * 3 * 32 * 32  # routed expert weights
    assert (bf16, mx) == (2 * n, n // 2 + n // 32)  # 16 vs 4.25 bits per weight
    print(f"routed experts: bf16 {bf16} B, mxfp4 {mx} B, ratio {bf16 / mx:.4f}")
    assert bf16 / mx == pytest.approx(64 / 17)


def test_hf_forward_of_the_export_equals_megatron_qat_forward(ws):
    from megatron_latentmoe.convert.dist_reader import open_checkpoint
    from megatron_latentmoe.convert.verify import (
        load_hf_model,
        load_megatron_model,
        megatron_logits,
        sample_tokens,
        verify_export,
    )

    root = ws["root"]
    report = verify_export(root / "ck", root / "hf_mx")
    print(report.format())
    assert report.passed, report.format()  # max |delta logits| <= 1e-4, 32 greedy tokens equal
    assert report.min_margin > 100 * report.max_abs_diff
    # the test can fail: without QAT the Megatron model is far from the MXFP4 export
    reader, arch, _, _ = open_checkpoint(root / "ck")
    tokens, _ = sample_tokens(root / "hf_mx", arch.vocab_size)
    plain = megatron_logits(load_megatron_model(reader.path, arch, "none"), tokens)
    with torch.no_grad():
        hf = load_hf_model(root / "hf_mx")(tokens).logits.float()
    assert (plain - hf).abs().max() > 1e3 * report.atol


def test_import_reads_mxfp4_back_and_re_export_is_identical(ws, tmp_path):
    from megatron_latentmoe.convert import export_checkpoint, import_checkpoint

    root = ws["root"]
    import_checkpoint(root / "hf_mx", tmp_path / "mg", progress=False)
    export_checkpoint(
        tmp_path / "mg",
        tmp_path / "hf_again",
        expert_dtype="mxfp4",
        progress=False,
        tokenizer_dir=None,
    )
    assert hf_tensors(tmp_path / "hf_again").keys() == hf_tensors(root / "hf_mx").keys()
    again, first = hf_tensors(tmp_path / "hf_again"), hf_tensors(root / "hf_mx")
    assert all(torch.equal(again[k], first[k]) for k in first)


def test_expert_width_not_a_multiple_of_32_is_refused_before_writing(ws, tmp_path):
    from megatron_latentmoe.convert import export_checkpoint

    with pytest.raises(
        ConversionError,
        match=r"moe_ffn_hidden_size=48 \(the reduction width of the "
        r"routed experts' w2\) is not a multiple of the MXFP4 block size 32",
    ):
        export_checkpoint(
            ws["root"] / "ck48", tmp_path / "out", expert_dtype="mxfp4", progress=False
        )
    assert not (tmp_path / "out").exists() and not list(tmp_path.iterdir())


def test_compressed_tensors_decompresses_the_export(ws):
    """compressed-tensors' own MXFP4 decompressor (what vLLM's loader builds on) reads our bytes."""
    pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    root = ws["root"]
    config = QuantizationConfig.model_validate(
        json.loads((root / "hf_mx" / "config.json").read_text())["quantization_config"]
    )
    scheme = config.config_groups["group_0"]
    compressor = BaseCompressor.get_value_from_registry(config.format)
    mx, plain = hf_tensors(root / "hf_mx"), hf_tensors(root / "hf_fp32")
    from megatron_latentmoe.ops.mxfp4 import mxfp4_round_trip

    for k in (k for k in plain if ".block_sparse_moe.experts." in k):
        packed, scale = mxfp4.names(k)
        dense = compressor.decompress(
            {"weight_packed": mx[packed], "weight_scale": mx[scale]}, scheme
        )["weight"]
        assert torch.equal(dense.float(), mxfp4_round_trip(plain[k])), k
    # transformers' compressed-tensors loader on the export == our own dequantizing loader, in
    # bf16 and fp32. Before transformers 5.23 that loader keeps the experts on compressed-tensors'
    # quantized forward with bf16 scales whatever the dtype asked for, so in fp32 its first GEMM
    # fails ("expected m1 and m2 to have the same dtype"; seen with 5.17.0 and 5.22.2).
    import transformers
    from packaging.version import Version
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    dtypes = [torch.bfloat16]
    if Version(transformers.__version__) >= Version("5.23"):
        dtypes.append(torch.float32)
    tokens = torch.randint(0, 4096, (2, 16), generator=torch.Generator().manual_seed(0))
    for dtype in dtypes:
        load = dict(trust_remote_code=True, dtype=dtype)
        ours = AutoModelForCausalLM.from_pretrained(str(root / "hf_mx"), **load)
        ct = AutoModelForCausalLM.from_pretrained(
            str(root / "hf_mx"),
            quantization_config=CompressedTensorsConfig(dequantize=True),
            **load,
        )
        with torch.no_grad():
            assert torch.equal(ct(tokens).logits, ours(tokens).logits), dtype


def test_hf_model_loaded_from_mxfp4_saves_as_a_dense_model(ws, tmp_path):
    from transformers import conversion_mapping

    from megatron_latentmoe.convert.verify import load_hf_model

    model = load_hf_model(ws["root"] / "hf_mx")
    assert conversion_mapping.get_checkpoint_conversion_mapping("stable_latentmoe") is None
    model.save_pretrained(tmp_path / "dense")
    from safetensors.torch import load_file

    saved = {k for f in (tmp_path / "dense").glob("*.safetensors") for k in load_file(str(f))}
    assert not any(k.endswith((mxfp4.PACKED, mxfp4.SCALE)) for k in saved)
    assert "quantization_config" not in json.loads((tmp_path / "dense" / "config.json").read_text())
    tokens = torch.randint(0, 4096, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(load_hf_model(tmp_path / "dense")(tokens).logits, model(tokens).logits)


def test_quantization_config_is_compressed_tensors_mxfp4():
    """config.json's quantization_config as compressed-tensors parses it: 4-bit float weights,
    symmetric (E2M1 has a sign bit, no zero point), one scale per 32 values along K, static
    (the scales are stored, not computed at load), on the routed expert linears only. And
    is_mxfp4 recognises exactly this layout: not a missing / empty config, not another
    compressed-tensors format, not another target."""
    ct = pytest.importorskip("compressed_tensors.quantization")
    config = mxfp4.quantization_config()
    parsed = ct.QuantizationConfig.model_validate(config)
    assert parsed.format == mxfp4.FORMAT and list(parsed.config_groups) == ["group_0"]
    group = parsed.config_groups["group_0"]
    w = group.weights
    assert (w.num_bits, w.type, w.symmetric, w.group_size, w.strategy, w.dynamic) == (
        4,
        "float",
        True,
        32,
        "group",
        False,
    )
    assert group.targets == [mxfp4.TARGET] and group.input_activations is None
    assert mxfp4.is_mxfp4(config)
    assert not mxfp4.is_mxfp4(None) and not mxfp4.is_mxfp4({})
    assert not mxfp4.is_mxfp4(dict(config, format="pack-quantized"))
    other = json.loads(json.dumps(config))
    other["config_groups"]["group_0"]["targets"] = ["Linear"]
    assert not mxfp4.is_mxfp4(other)
    assert not mxfp4.is_mxfp4(dict(config, quant_method="fp8"))


def test_quantization_config_targets_exactly_the_routed_expert_linears(ws):
    """Matched the way compressed-tensors (and vLLM's loader built on it) match a scheme to
    modules, the config's targets / ignore select every routed expert linear of the model and
    nothing else (not the shared experts, the latent projections, attention, the router or the
    LM head), with uint8 scales. transformers' compressed-tensors loader dequantizes any
    ``weight_packed`` pair whatever the targets, so the export tests above cannot see this."""
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.utils.match import match_named_modules

    from megatron_latentmoe.convert.verify import load_hf_model

    parsed = ct.quantization.QuantizationConfig.model_validate(mxfp4.quantization_config())
    group = parsed.config_groups["group_0"]
    assert group.weights.scale_dtype == torch.uint8
    model = load_hf_model(ws["root"] / "hf_fp32")
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    routed = {n for n in linears if ".block_sparse_moe.experts." in n}
    assert len(routed) == 3 * 8 * 3 and any(".shared_experts." in n for n in linears)
    matched = {n for n, _ in match_named_modules(model, group.targets, parsed.ignore)}
    assert matched == routed


def test_bf16_export_quantizes_the_checkpoint_values_not_their_bf16_cast(ws, tmp_path):
    """``--dtype bf16 --expert-dtype mxfp4`` of an fp32 checkpoint: the routed experts are the
    same bytes as in the fp32 export (quantized before any cast, what fp32 QAT trained on);
    quantizing the bf16-rounded weights instead changes some codes."""
    from megatron_latentmoe.convert import export_checkpoint

    root = ws["root"]
    export_checkpoint(
        root / "ck", tmp_path / "hf", dtype="bf16", expert_dtype="mxfp4", progress=False
    )
    bf16, fp32, plain = (
        hf_tensors(tmp_path / "hf"),
        hf_tensors(root / "hf_mx"),
        hf_tensors(root / "hf_fp32"),
    )
    experts = [k for k in plain if ".block_sparse_moe.experts." in k]
    packed = [n for k in experts for n in mxfp4.names(k)]
    assert len(packed) == 2 * 3 * 8 * 3
    assert all(torch.equal(bf16[n], fp32[n]) for n in packed)
    cast = [mxfp4.pack(k, plain[k].bfloat16()) for k in experts]
    assert any(not torch.equal(t, fp32[n]) for c in cast for n, t in c.items())
