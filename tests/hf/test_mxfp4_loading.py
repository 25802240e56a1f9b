"""An MXFP4 export (``convert export --expert-dtype mxfp4``) loads with the ``from_pretrained``
arguments a transformers user passes to any model: the model code's MXFP4 path (which drops the
``quantization_config`` and dequantizes the routed experts) must not lose or trip over them.

The folder is built here without Megatron: a tiny model saved by ``save_pretrained`` whose routed
expert weights are then replaced by their MXFP4 pairs (``convert.mxfp4.pack``, what the export
writes) and whose config.json gets the export's ``quantization_config``.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from megatron_latentmoe.convert import mxfp4  # noqa: E402
from megatron_latentmoe.hf import StableLatentMoEForCausalLM, copy_remote_code  # noqa: E402
from tests.unit.test_hf_modeling import randomize_, tiny_config  # noqa: E402

pytestmark = pytest.mark.timeout(120)

TOKENS = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 3, 40, 2, 7, 7]])


@pytest.fixture(scope="module")
def mx(tmp_path_factory):
    """(MXFP4 folder, logits of the dense model holding the dequantized expert weights)."""
    root = tmp_path_factory.mktemp("mxfp4")
    cfg = tiny_config(routed_expert_hidden_size=32, moe_intermediate_size=32)  # MXFP4 blocks: 32
    torch.manual_seed(0)
    model = StableLatentMoEForCausalLM(cfg).eval()
    randomize_(model, std=0.3)
    model.save_pretrained(root)
    copy_remote_code(root)
    (weights_file,) = root.glob("*.safetensors")
    tensors = load_file(str(weights_file))
    experts = [k for k in tensors if ".experts." in k]
    assert len(experts) == 3 * cfg.num_experts * (cfg.num_hidden_layers - 1)
    state = model.state_dict()
    for name in experts:
        pair = mxfp4.pack(name, tensors.pop(name))
        tensors.update(pair)
        state[name] = mxfp4.unpack(name, pair, torch.float32)
    save_file(tensors, str(weights_file), metadata={"format": "pt"})
    config = json.loads((root / "config.json").read_text())
    config["quantization_config"] = mxfp4.quantization_config()
    (root / "config.json").write_text(json.dumps(config))
    model.load_state_dict(state)
    with torch.no_grad():
        return root, model(TOKENS, use_cache=False).logits


def _load(how, folder, **kwargs):
    if how == "auto":
        return transformers.AutoModelForCausalLM.from_pretrained(
            folder, trust_remote_code=True, **kwargs
        )
    return StableLatentMoEForCausalLM.from_pretrained(folder, **kwargs)


def _logits(model):
    with torch.no_grad():
        return model.eval()(TOKENS, use_cache=False).logits


@pytest.mark.parametrize("how", ["auto", "class"])
def test_output_loading_info_returns_the_model_and_a_clean_report(mx, how):
    folder, want = mx
    model, info = _load(how, folder, output_loading_info=True)
    assert not any(info.values()), info  # no missing / unexpected / mismatched key
    assert torch.equal(_logits(model), want)
    assert model._weight_conversions == []  # save_pretrained writes the dense weights


@pytest.mark.parametrize("how", ["auto", "class"])
def test_attn_implementation_is_the_one_asked_for(mx, how):
    folder, want = mx
    model = _load(how, folder, attn_implementation="eager")
    assert model.config._attn_implementation == "eager"
    assert model.model.layers[1].self_attn.config._attn_implementation == "eager"
    torch.testing.assert_close(_logits(model), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("how", ["auto", "class"])
def test_config_overrides_apply(mx, how):
    folder, want = mx
    model = _load(how, folder, num_hidden_layers=2, output_router_logits=True)
    assert len(model.model.layers) == model.config.num_hidden_layers == 2
    assert model.config.output_router_logits is True
    assert not hasattr(model.config, "quantization_config")
    with torch.no_grad():
        out = model.eval()(TOKENS, use_cache=False)
    assert len(out.router_logits) == 1  # the dense layer 0, one MoE layer
    # a config given as a path is read like the folder's own
    by_path = _load(how, folder, config=str(folder / "config.json"))
    assert len(by_path.model.layers) == 3 and torch.equal(_logits(by_path), want)


@pytest.mark.parametrize("how", ["auto", "class"])
def test_the_dtype_asked_for_applies(mx, how):
    """``dtype=torch.bfloat16``: the experts dequantize straight into bf16 like every other
    weight; the router's QB bias stays fp32."""
    folder, want = mx
    model = _load(how, folder, dtype=torch.bfloat16)
    block = model.model.layers[1].block_sparse_moe
    assert model.dtype == block.experts[0].w1.weight.dtype == torch.bfloat16
    assert block.gate.e_score_correction_bias.dtype == torch.float32
    got = _logits(model).float()
    assert (got - want).norm() / want.norm() < 0.05


def test_only_the_mxfp4_format_is_dequantized_on_load():
    """Another ``quantization_config`` (another compressed-tensors format, say) goes to
    transformers' own quantizer: dropping it would load its packed weights as plain ones."""
    from megatron_latentmoe.hf.modeling_stable_latentmoe import _is_mxfp4_experts

    class AsObject:  # what transformers holds once it parsed config.json
        def __init__(self, d):
            self.d = d

        def to_dict(self):
            return self.d

    ours = mxfp4.quantization_config()
    other = {**ours, "format": "float-quantized"}
    assert _is_mxfp4_experts(ours) and _is_mxfp4_experts(AsObject(ours))
    assert not any(map(_is_mxfp4_experts, (other, AsObject(other), None, {})))
