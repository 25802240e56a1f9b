"""Fast unit tests of the exporter (``convert/export.py``) and the importer (``importer.py``).

No Megatron model and no spawned ranks: a tiny HF directory is written by hand, imported into a
Megatron ``torch_dist`` checkpoint in-process, and exported back (about 6 s in all). The slow
end-to-end tests over REAL Megatron checkpoints are in ``test_convert.py`` / ``test_bad_input.py``.
"""

from __future__ import annotations

import json
import os
import struct
import weakref
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_latentmoe.convert import ConversionError, ModelArch
from megatron_latentmoe.convert.dist_reader import DistCheckpointReader
from megatron_latentmoe.convert.export import (
    HF_CODE_DIR,
    INDEX_FILE,
    REMOTE_CODE_FILES,
    ShardedSafetensorsWriter,
    _batches,
    _expected_lead,
    cast_checked,
    check_expert_dtype,
    export_checkpoint,
    match_checkpoint,
    parse_dtype,
    parse_size,
    prepare_hf_metadata,
    tokenizer_files,
    write_hf_metadata,
)
from megatron_latentmoe.convert.importer import import_checkpoint
from megatron_latentmoe.convert.names import iter_tensor_maps

from . import _workers
from .conftest import hf_tensors

TINY = dict(
    _workers.TEST_ARCH,
    num_layers=2,
    hidden_size=16,
    ffn_hidden_size=24,
    num_attention_heads=2,
    num_query_groups=1,
    kv_channels=8,
    vocab_size=96,
    num_experts=4,
    moe_shared_expert_intermediate_size=32,
)
"""One dense layer and one MoE layer (4 experts, latent 32): 38 HF tensors, 83,152 fp32 bytes."""
N_HF_TENSORS = 38
N_MEGATRON_TENSORS = 28
N_CHECKPOINT_KEYS = 22  # the 4 experts' 8 tensors are chunks of 2 stacked keys
LARGEST = 2 * 32 * 32  # elements of a routed expert's linear_fc1 (its w1 and w3)


def no_leftovers(parent) -> bool:
    return not [n for n in os.listdir(parent) if ".partial-" in n or ".old-" in n]


def write_hf_dir(directory, arch: ModelArch, dtype=torch.float32, extra=None) -> dict:
    """An HF directory of ``arch`` with random weights in one ``model.safetensors``."""
    directory.mkdir()
    (directory / "config.json").write_text(
        json.dumps(dict(model_type="stable_latentmoe", **arch.to_hf_config_kwargs()))
    )
    g = torch.Generator().manual_seed(0)
    tensors = {
        name: torch.randn(shape, generator=g).to(dtype)
        for tm in iter_tensor_maps(arch)
        for name, shape in tm.hf
    }
    tensors.update(extra or {})
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return tensors


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    arch = ModelArch(**TINY)
    tensors = write_hf_dir(root / "hf", arch)
    imported = import_checkpoint(root / "hf", root / "mg", progress=False)
    exported = export_checkpoint(
        root / "mg", root / "out", max_shard_size="20KB", tokenizer_dir=None, progress=False
    )
    return SimpleNamespace(
        root=root, arch=arch, tensors=tensors, imported=imported, exported=exported
    )


# ------------------------------------------------------------------------------ option parsing
@pytest.mark.parametrize(
    "text, size",
    [
        ("5GB", 5 * 10**9),
        ("500MB", 500 * 10**6),
        ("300KB", 300_000),
        ("1.5KB", 1500),
        ("2TB", 2 * 10**12),
        ("2GiB", 2 << 30),
        (" 300kib ", 300 << 10),
        ("7MiB", 7 << 20),
        ("3TiB", 3 << 40),
        ("64B", 64),
        ("123", 123),
        (4096, 4096),
    ],
)
def test_parse_size_units(text, size):
    assert parse_size(text) == size


def test_parse_dtype_takes_short_and_torch_names():
    assert parse_dtype("auto") is None and parse_dtype(None) is None
    assert [parse_dtype(n) for n in ("bf16", "fp32", "fp16")] == [
        torch.bfloat16,
        torch.float32,
        torch.float16,
    ]
    assert [parse_dtype(n) for n in ("bfloat16", "float32", "float16")] == [
        torch.bfloat16,
        torch.float32,
        torch.float16,
    ]
    with pytest.raises(ConversionError) as info:
        parse_dtype("fp64")
    assert str(info.value) == "dtype='fp64' is not allowed: one of auto, bf16, fp32, fp16"


def test_check_expert_dtype():
    arch = ModelArch(**TINY)
    assert check_expert_dtype("auto", arch) is False
    assert check_expert_dtype("mxfp4", arch) is True
    with pytest.raises(ConversionError) as info:
        check_expert_dtype("int4", arch)
    assert str(info.value) == "expert_dtype='int4' is not allowed: one of ('auto', 'mxfp4')"
    for field, value, tensors in (
        ("moe_latent_size", 48, "w1/w3"),
        ("moe_ffn_hidden_size", 16, "w2"),
    ):
        with pytest.raises(ConversionError) as info:
            check_expert_dtype("mxfp4", ModelArch(**dict(TINY, **{field: value})))
        assert str(info.value) == (
            f"--expert-dtype mxfp4: {field}={value} (the reduction width of the routed experts' "
            f"{tensors}) is not a multiple of the MXFP4 block size 32; MXFP4 blocks are never "
            "padded. Export with --expert-dtype auto"
        )


# ------------------------------------------------------------------------- safetensors writer
F32 = torch.float32


def test_shards_fill_up_to_the_cap_and_are_numbered_of_the_count(tmp_path):
    """A shard takes tensors while the total stays <= the cap (exactly full is allowed); a tensor
    larger than the cap gets a shard of its own; files are ``model-0000i-of-0000N``."""
    plan = [
        ("big", (20,), F32),  # 80 bytes > the cap: alone, in the first shard
        ("a", (2, 2), F32),  # 16
        ("b", (4,), torch.bfloat16),  # 8 -> 24
        ("c", (2,), F32),  # 8 -> 32: exactly the cap, same shard
        ("d", (1,), torch.uint8),  # 1 -> 33: a new shard
    ]
    w = ShardedSafetensorsWriter(tmp_path, plan, 32)
    assert w.files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert w.weight_map == {
        "big": w.files[0],
        "a": w.files[1],
        "b": w.files[1],
        "c": w.files[1],
        "d": w.files[2],
    }
    assert w.total_bytes == 80 + 16 + 8 + 8 + 1


def test_writer_output_is_valid_safetensors_with_an_exact_index(tmp_path):
    tensors = {
        "w": torch.arange(6, dtype=F32).reshape(2, 3),
        "bias": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        "packed": torch.tensor([[1, 2, 255]], dtype=torch.uint8),
        "half": torch.tensor([0.5], dtype=torch.float16),
    }
    plan = [(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
    w = ShardedSafetensorsWriter(tmp_path, plan, 28)  # w: 24; bias 4 -> 28; packed 3 -> new
    assert [w.write(n, t) for n, t in tensors.items()] == [24, 4, 3, 2]
    assert w.bytes_written == 33
    w.close()
    assert sorted(os.listdir(tmp_path)) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        INDEX_FILE,
    ]
    assert (tmp_path / INDEX_FILE).read_text() == (
        "{\n"
        '  "metadata": {\n'
        '    "total_size": 33\n'
        "  },\n"
        '  "weight_map": {\n'
        '    "bias": "model-00001-of-00002.safetensors",\n'
        '    "half": "model-00002-of-00002.safetensors",\n'
        '    "packed": "model-00002-of-00002.safetensors",\n'
        '    "w": "model-00001-of-00002.safetensors"\n'
        "  }\n"
        "}\n"
    )
    back = hf_tensors(tmp_path)
    assert sorted(back) == sorted(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    raw = (tmp_path / "model-00001-of-00002.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0 and len(raw) == 8 + n + 28  # the data starts 8-byte aligned
    assert json.loads(raw[8 : 8 + n]) == {
        "__metadata__": {"format": "pt"},
        "w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
        "bias": {"dtype": "BF16", "shape": [2], "data_offsets": [24, 28]},
    }
    with safe_open(str(tmp_path / "model-00002-of-00002.safetensors"), framework="pt") as h:
        assert h.metadata() == {"format": "pt"}


def test_writer_refuses_what_the_plan_does_not_say(tmp_path):
    with pytest.raises(ConversionError) as info:
        ShardedSafetensorsWriter(tmp_path, [("a", (1,), F32), ("a", (2,), F32)], 100)
    assert str(info.value) == "tensor 'a' planned twice"
    plan = [("a", (2,), F32), ("b", (3,), F32)]
    w = ShardedSafetensorsWriter(tmp_path, plan, 100)
    for name, t, message in (
        ("b", torch.zeros(3), "tensor 'b' written out of order (expected 'a')"),
        (
            "a",
            torch.zeros(3),
            "tensor 'a': got (3,) torch.float32, planned (2,) torch.float32",
        ),
        (
            "a",
            torch.zeros(2, dtype=torch.bfloat16),
            "tensor 'a': got (2,) torch.bfloat16, planned (2,) torch.float32",
        ),
    ):
        with pytest.raises(ConversionError) as info:
            w.write(name, t)
        assert str(info.value) == message
    w.write("a", torch.zeros(2))
    with pytest.raises(ConversionError) as info:
        w.close()
    assert str(info.value) == "only 1 of 2 tensors were written (next expected: 'b')"
    assert not (tmp_path / INDEX_FILE).exists()
    w = ShardedSafetensorsWriter(tmp_path, plan, 100)
    w.write("a", torch.zeros(2))
    w.write("b", torch.zeros(3))
    with pytest.raises(ConversionError) as info:
        w.write("c", torch.zeros(1))
    assert str(info.value) == "tensor 'c' was not planned"


# ------------------------------------------------------------------------------ small helpers
def test_fp16_cast_refuses_only_finite_values_beyond_its_range():
    top = torch.tensor([-65519.0, 1.0])  # rounds to -65504: fits
    assert torch.equal(
        cast_checked("x", top, torch.float16, "fp16"), torch.tensor([-65504.0, 1.0]).half()
    )
    for t in (
        torch.tensor([float("inf"), -1.0]),
        torch.tensor([float("-inf")]),
        torch.tensor([65504.0, float("inf")]),  # fp16's largest itself fits
    ):
        assert torch.equal(cast_checked("x", t, torch.float16, "fp16"), t.half())  # inf was there
    assert cast_checked("x", torch.tensor([1e30]), torch.bfloat16, "bf16").item() == pytest.approx(
        1e30, 0.01
    )
    with pytest.raises(ConversionError) as info:
        cast_checked(
            "w.weight", torch.tensor([1.0, -65520.0, float("inf")]), torch.float16, "float16"
        )
    assert str(info.value) == (
        "dtype='float16' is not allowed: bf16 or fp32 for this checkpoint: 'w.weight' holds "
        "|values| up to 6.552e+04, above fp16's largest, 65504"
    )


def test_expected_stacked_axes_of_checkpoint_keys():
    arch = ModelArch(**dict(TINY, num_layers=3, num_experts=5))
    assert _expected_lead("embedding.word_embeddings.weight", arch) == ()
    assert _expected_lead("decoder.layers.0.self_attention.linear_qkv.weight", arch) == ()
    assert _expected_lead("decoder.layers.self_attention.linear_qkv.weight", arch) == (3,)
    assert _expected_lead("decoder.layers.1.mlp.experts.experts.linear_fc1.weight", arch) == (5,)
    assert _expected_lead("decoder.layers.mlp.experts.experts.linear_fc2.weight", arch) == (3, 5)
    assert _expected_lead("decoder.layers.1.mlp.experts.experts.0.linear_fc1.weight", arch) == ()


def test_checkpoint_tensors_must_be_floating_point(tiny, monkeypatch):
    """A model tensor stored as integers (of the right shape) is refused by name: an export would
    write values that are not the weights."""
    reader = DistCheckpointReader(tiny.root / "mg")
    assert match_checkpoint(reader, tiny.arch, "ck") == N_MEGATRON_TENSORS
    key, stored = "embedding.word_embeddings.weight", reader.dtype
    monkeypatch.setattr(reader, "dtype", lambda k: torch.int64 if k == key else stored(k))
    with pytest.raises(ConversionError) as info:
        match_checkpoint(reader, tiny.arch, "ck")
    assert str(info.value) == (
        "checkpoint 'ck' does not match the model config:\n  shape mismatch (1):\n    "
        "embedding.word_embeddings.weight: dtype torch.int64 is not floating point"
    )


def test_a_router_without_expert_bias_is_not_counted_as_a_located_tensor(tiny, monkeypatch):
    """The count match_checkpoint returns (the export summary's megatron_tensors) is of the
    tensors the checkpoint stores: a router trained without an expert bias has none (its HF bias
    is written as zeros, not read)."""
    reader = DistCheckpointReader(tiny.root / "mg")
    keys = reader.model_keys
    monkeypatch.setattr(
        reader, "model_keys", lambda: [k for k in keys() if not k.endswith(".expert_bias")]
    )
    aux = ModelArch(**dict(TINY, moe_router_load_balancing_type="aux_loss"))
    assert match_checkpoint(reader, aux, "ck") == N_MEGATRON_TENSORS - 1  # the one MoE layer's


def test_read_batches_fill_up_to_the_budget():
    def maps(*numels):
        return [SimpleNamespace(name=i, numel=lambda n=n: n) for i, n in enumerate(numels)]

    def batches(numels, budget):
        return [[tm.name for tm in b] for b in _batches(maps(*numels), budget)]

    assert batches((10, 10, 10), 80) == [[0, 1], [2]]  # 4 bytes an element: exactly full
    assert batches((10, 10, 10), 79) == [[0], [1], [2]]
    assert batches((100, 1, 1), 8) == [[0], [1, 2]]  # a tensor above the budget: alone
    assert batches((), 8) == []


def test_only_tokenizer_files_are_shipped(tmp_path):
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.json",
        "merges.txt",
        "spm.model",
        "cl100k.tiktoken",
        "tokenization_mine.py",
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "README.md",
    ):
        (tmp_path / name).write_text("x")
    (tmp_path / "tokenizer_dir.json").mkdir()  # a directory: not a file to copy
    assert [p.name for p in tokenizer_files(tmp_path)] == [
        "added_tokens.json",
        "chat_template.jinja",
        "cl100k.tiktoken",
        "merges.txt",
        "special_tokens_map.json",
        "spm.model",
        "tokenization_mine.py",
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.json",
    ]


def test_hf_metadata_keeps_each_token_id_in_its_place(tmp_path):
    """A tokenizer of exactly ``vocab_size`` tokens fits (one more token does not); config.json
    and generation_config.json carry the model description's bos / eos / pad ids, each under
    its own key (the tiny model's bos == eos could not tell them apart)."""
    from megatron_latentmoe.data.corpus import default_tokenizer_dir

    ids = dict(bos_token_id=5, eos_token_id=6, pad_token_id=7)
    arch = ModelArch(**dict(TINY, vocab_size=4096, **ids))
    config, kept, files = prepare_hf_metadata(arch, torch.bfloat16, default_tokenizer_dir())
    assert kept == arch
    write_hf_metadata(tmp_path, config, kept, files)
    cfg = json.loads((tmp_path / "config.json").read_text())
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    for saved in (cfg, gen):
        assert {k: saved[k] for k in ids} == ids
    assert (cfg["vocab_size"], cfg["dtype"]) == (4096, "bfloat16")
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["config.json", "generation_config.json", *REMOTE_CODE_FILES, *(p.name for p in files)]
    )
    with pytest.raises(ConversionError) as info:
        prepare_hf_metadata(ModelArch(**dict(TINY, vocab_size=4095)), F32, default_tokenizer_dir())
    assert str(info.value) == (
        f"tokenizer {default_tokenizer_dir()!r} has 4096 tokens, more than the model's "
        "vocab_size=4095"
    )


def test_adopted_token_ids_keep_the_models_where_the_tokenizer_has_none(tmp_path):
    """adopt_token_ids (a megatron.training checkpoint) takes bos / eos / pad from the tokenizer;
    one the tokenizer does not define (here pad) keeps the model description's, not None."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "a", "<s>", "</s>"]
    PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, "<unk>")),
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
    ).save_pretrained(tmp_path)
    arch = ModelArch(**dict(TINY, bos_token_id=0, eos_token_id=0, pad_token_id=1))
    _, adopted, _ = prepare_hf_metadata(arch, F32, str(tmp_path), adopt_token_ids=True)
    assert (adopted.bos_token_id, adopted.eos_token_id, adopted.pad_token_id) == (2, 3, 1)


# ------------------------------------------------------------------------- export end to end
def test_export_writes_exactly_the_hf_tensors_it_was_given(tiny):
    out = tiny.root / "out"
    assert sorted(os.listdir(out)) == [
        "config.json",
        "configuration_stable_latentmoe.py",
        "generation_config.json",
        *(f"model-0000{i}-of-00005.safetensors" for i in range(1, 6)),
        INDEX_FILE,
        "modeling_stable_latentmoe.py",
    ]
    back = hf_tensors(out)
    assert len(back) == N_HF_TENSORS and sorted(back) == sorted(tiny.tensors)
    for name, t in tiny.tensors.items():
        assert back[name].dtype == F32 and torch.equal(back[name], t), name
    index = json.loads((out / INDEX_FILE).read_text())
    assert index["metadata"] == {"total_size": 83_152}
    assert sum(t.numel() * 4 for t in back.values()) == 83_152
    for name, file in index["weight_map"].items():
        with safe_open(str(out / file), framework="pt") as h:
            assert name in h.keys(), (name, file)
    for name in REMOTE_CODE_FILES:
        assert (out / name).read_bytes() == (HF_CODE_DIR / name).read_bytes(), name
    assert no_leftovers(tiny.root)


def test_export_summary(tiny):
    s = tiny.exported
    assert (s.tensors, s.files, s.bytes_written) == (N_HF_TENSORS, 10, 83_152)
    assert s.bytes_read == 83_152
    assert s.largest_tensor_bytes == LARGEST * 4
    assert s.config_source == "checkpoint common state (stable_latentmoe_config)"
    assert {k: s.extra[k] for k in ("dtype", "shards", "expert_dtype")} == {
        "dtype": "float32",
        "shards": 5,
        "expert_dtype": "auto",
    }
    # 2 x (32 x 32) w1/w3 and 1 x (32 x 32) w2 per expert, 4 experts, fp32
    assert s.extra["routed_expert_bytes"] == 4 * 3 * 32 * 32 * 4
    assert s.extra["megatron_tensors"] == N_MEGATRON_TENSORS


def test_export_config_and_generation_config(tiny):
    cfg = json.loads((tiny.root / "out" / "config.json").read_text())
    cfg.pop("transformers_version")
    assert cfg == {
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "architectures": ["StableLatentMoEForCausalLM"],
        "attention_dropout": 0.0,
        "auto_map": {
            "AutoConfig": "configuration_stable_latentmoe.StableLatentMoEConfig",
            "AutoModel": "modeling_stable_latentmoe.StableLatentMoEModel",
            "AutoModelForCausalLM": "modeling_stable_latentmoe.StableLatentMoEForCausalLM",
        },
        "bos_token_id": 0,
        "dtype": "float32",
        "eos_token_id": 0,
        "first_k_dense_replace": 1,
        "head_dim": 8,
        "hidden_act": "situ",
        "hidden_size": 16,
        "initializer_range": 0.02,
        "intermediate_size": 24,
        "latent_moe_use_norm": True,
        "max_position_embeddings": 256,
        "model_type": "stable_latentmoe",
        "moe_intermediate_size": 32,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "num_attention_heads": 2,
        "num_expert_group": 1,
        "num_experts": 4,
        "num_experts_per_token": 2,
        "num_hidden_layers": 2,
        "num_key_value_heads": 1,
        "num_shared_experts": 1,
        "output_router_logits": False,
        "pad_token_id": 1,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "routed_expert_hidden_size": 32,
        "routed_scaling_factor": 1.0,
        "tie_word_embeddings": False,
        "topk_method": "noaux_tc",
        "use_cache": True,
        "vocab_size": 96,
    }
    assert ModelArch.from_hf_config(cfg) == tiny.arch
    gen = json.loads((tiny.root / "out" / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (0, 0, 1)


def test_fp16_export_keeps_the_expert_bias_fp32_and_one_read_batch_per_tensor(tiny, tmp_path):
    """``--dtype float16`` (torch's name) with the smallest read batch: every tensor fp16 but
    ``e_score_correction_bias`` (fp32, bit-exact); the default 5GB cap gives one shard."""
    s = export_checkpoint(
        tiny.root / "mg",
        tmp_path / "out",
        dtype="float16",
        tokenizer_dir=None,
        read_batch_bytes=1,
        progress=False,
    )
    index = json.loads((tmp_path / "out" / INDEX_FILE).read_text())
    assert set(index["weight_map"].values()) == {"model-00001-of-00001.safetensors"}
    back = hf_tensors(tmp_path / "out")
    assert sorted(back) == sorted(tiny.tensors)
    bias = "model.layers.1.block_sparse_moe.gate.e_score_correction_bias"
    assert back[bias].dtype == F32 and torch.equal(back[bias], tiny.tensors[bias])
    for name, t in back.items():
        if name != bias:
            assert t.dtype == torch.float16 and torch.equal(t, tiny.tensors[name].half()), name
    assert index["metadata"]["total_size"] == 4 * 4 + 2 * (83_152 - 4 * 4) // 4
    assert (s.extra["dtype"], s.extra["shards"], s.bytes_written) == ("float16", 1, 41_584)
    assert s.largest_tensor_bytes == LARGEST * 4  # the fp32 checkpoint tensor, not the fp16 one
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "float16"


def test_export_frees_each_read_batch_before_reading_the_next(tiny, tmp_path, monkeypatch):
    """Peak memory is one read batch plus a tensor, not two batches: before the next batch is
    read, the tensors of a batch are freed but the last one converted (the loop's variables);
    the iterator over a batch held all of them."""
    read = DistCheckpointReader.read_locations
    storages, held = [], []

    def tracking(self, locs):
        held.append(sum(r() is not None for r in storages))
        out = read(self, locs)
        storages.extend(weakref.ref(t.untyped_storage()) for t in out)
        return out

    monkeypatch.setattr(DistCheckpointReader, "read_locations", tracking)
    export_checkpoint(
        tiny.root / "mg",
        tmp_path / "out",
        tokenizer_dir=None,
        read_batch_bytes=16_000,
        progress=False,
    )
    assert (len(held), len(storages)) == (7, N_MEGATRON_TENSORS)  # 28 tensors in 7 batches
    assert max(held) == 1


def test_token_ids_of_a_megatron_training_checkpoint(tiny, tmp_path, monkeypatch):
    """A megatron.training checkpoint (common state: its args, no model description) takes bos /
    eos / pad from the tokenizer it ships; described by ``config_file``, that file's ids stay."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from megatron_latentmoe.convert import export as export_module

    words = ["<unk>", "a", "<s>", "</s>", "<pad>"]
    PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, "<unk>")),
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    ).save_pretrained(tmp_path / "tok")
    opened = export_module.open_checkpoint

    def trained_by_megatron(checkpoint, config_file):
        reader, arch, source, _ = opened(checkpoint, config_file)
        args = SimpleNamespace(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=None)
        return reader, arch, source, {"args": args}

    monkeypatch.setattr(export_module, "open_checkpoint", trained_by_megatron)
    config = tiny.root / "out" / "config.json"
    for name, config_file, ids in (("a", None, (2, 3, 4)), ("b", str(config), (0, 0, 1))):
        export_checkpoint(
            tiny.root / "mg",
            tmp_path / name,
            config_file=config_file,
            tokenizer_dir=str(tmp_path / "tok"),
            progress=False,
        )
        for file in ("config.json", "generation_config.json"):
            saved = json.loads((tmp_path / name / file).read_text())
            assert (saved["bos_token_id"], saved["eos_token_id"], saved["pad_token_id"]) == ids


# ------------------------------------------------------------------------------ export refusals
def _export_fails(tiny, out, message, **kw):
    kw = dict(dict(tokenizer_dir=None, progress=False), **kw)
    with pytest.raises(ConversionError) as info:
        export_checkpoint(tiny.root / "mg", out, **kw)
    assert str(info.value) == message
    assert not os.path.isdir(out.parent) or no_leftovers(out.parent)


def test_export_refuses_bad_options_and_outputs_before_writing(tiny, tmp_path):
    out = tmp_path / "out"
    for kw, message in (
        (dict(max_shard_size="0"), "max_shard_size='0' is not allowed: a positive size"),
        (dict(max_shard_size="-1GB"), "max_shard_size='-1GB' is not allowed: a positive size"),
        (dict(dtype="fp64"), "dtype='fp64' is not allowed: one of auto, bf16, fp32, fp16"),
        (
            dict(expert_dtype="int4"),
            "expert_dtype='int4' is not allowed: one of ('auto', 'mxfp4')",
        ),
    ):
        _export_fails(tiny, out, message, **kw)
        assert not out.exists()
    _export_fails(
        tiny,
        tmp_path / "no" / "out",
        f"the parent directory of the output, {str(tmp_path / 'no')!r}, does not exist",
    )
    out.write_text("a file")
    _export_fails(tiny, out, f"output {str(out)!r} exists and is not a directory", overwrite=True)
    out.unlink()
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    _export_fails(
        tiny,
        out,
        f"output directory {str(out)!r} exists and is not empty; pass --overwrite to replace it",
    )
    assert os.listdir(out) == ["keep.txt"]


@pytest.mark.parametrize("where", ["tensors", "metadata"])
def test_export_failing_midway_leaves_no_output_and_keeps_the_old_one(
    tiny, tmp_path, monkeypatch, where
):
    """A failure while the shards stream (after some are written) or while the config is written
    removes the temporary directory; with --overwrite the previous output stays as it was."""
    from megatron_latentmoe.convert import export as export_module

    if where == "tensors":
        original = ShardedSafetensorsWriter.write

        def write(self, name, tensor):
            if self._pos == 30:
                raise ConversionError("disk full")
            return original(self, name, tensor)

        monkeypatch.setattr(ShardedSafetensorsWriter, "write", write)
    else:

        def write_hf_metadata(*args):
            raise ConversionError("disk full")

        monkeypatch.setattr(export_module, "write_hf_metadata", write_hf_metadata)
    _export_fails(tiny, tmp_path / "out", "disk full", max_shard_size="20KB")
    assert os.listdir(tmp_path) == []
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("previous")
    _export_fails(tiny, tmp_path / "out", "disk full", max_shard_size="20KB", overwrite=True)
    assert os.listdir(tmp_path) == ["out"]
    assert os.listdir(tmp_path / "out") == ["keep.txt"]


def test_fp64_checkpoint_needs_an_export_dtype(tiny, tmp_path):
    """An fp64 HF model imports as fp64 (``auto``); its export must name a dtype HF configs
    know. With ``--dtype fp32`` the values come back exactly (they were fp32 values)."""
    arch = ModelArch(**TINY)
    tensors = write_hf_dir(tmp_path / "hf", arch, dtype=torch.float64)
    import_checkpoint(tmp_path / "hf", tmp_path / "mg", progress=False)
    reader = DistCheckpointReader(tmp_path / "mg")
    assert {str(reader.dtype(k)) for k in reader.model_keys() if not k.endswith("expert_bias")} == {
        "torch.float64"
    }
    with pytest.raises(ConversionError) as info:
        export_checkpoint(tmp_path / "mg", tmp_path / "out", tokenizer_dir=None, progress=False)
    assert str(info.value) == (
        "checkpoint dtype torch.float64 cannot be exported; pass --dtype bf16/fp32"
    )
    assert sorted(os.listdir(tmp_path)) == ["hf", "mg"]
    s = export_checkpoint(
        tmp_path / "mg", tmp_path / "out", dtype="fp32", tokenizer_dir=None, progress=False
    )
    assert s.largest_tensor_bytes == LARGEST * 8  # the fp64 checkpoint tensor
    back = hf_tensors(tmp_path / "out")
    for name, t in tensors.items():
        assert back[name].dtype == F32 and torch.equal(back[name], t.float()), name


# ------------------------------------------------------------------------------------- import
def test_import_writes_a_release_save_root(tiny):
    mg = tiny.root / "mg"
    assert sorted(os.listdir(mg)) == ["latest_checkpointed_iteration.txt", "release"]
    assert (mg / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert sorted(os.listdir(mg / "release")) == [".metadata", "__0_0.distcp", "metadata.json"]
    assert json.loads((mg / "release" / "metadata.json").read_text()) == {
        "sharded_backend": "torch_dist",
        "sharded_backend_version": 1,
    }
    s = tiny.imported
    assert (s.tensors, s.files) == (N_CHECKPOINT_KEYS, 3)
    assert s.extra["megatron_tensors"] == N_MEGATRON_TENSORS
    assert s.extra["checkpoint_dir"] == f"{mg}/release"
    assert s.bytes_read == 83_152
    assert s.largest_tensor_bytes == LARGEST * 4
    assert s.bytes_written == sum(p.stat().st_size for p in (mg / "release").iterdir())
    common = DistCheckpointReader(mg).common_state()
    assert (common["iteration"], common["checkpoint_version"]) == (0, 3.0)
    assert common["num_floating_point_operations_so_far"] == 0
    assert common["stable_latentmoe_config"] == tiny.arch.to_dict()
    assert common["args"].num_layers == 2 and common["args"].hidden_size == 16
    assert common["content_metadata"] == {
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
    }
    objects = DistCheckpointReader(mg).byte_objects
    assert len(objects) == 17  # 6 dense linears + 4 experts x 2 linears + the common state
    assert "decoder.layers.1.mlp.experts.experts.linear_fc2._extra_state/shard_3_4" in objects
    assert no_leftovers(tiny.root)


def test_import_holds_one_tensor_at_a_time(tiny, tmp_path, monkeypatch):
    """Each tensor is freed once it is written: DCP's ``FileSystemWriter.write_data`` kept every
    tensor written to a file until the file was closed (the last of each checkpoint key), so the
    import's memory grew with the checkpoint."""
    from megatron_latentmoe.convert import importer

    write = importer._write_data
    storages, held = [], []

    def tracking(resolve):
        def tracked():
            held.append(sum(r() is not None for r in storages))
            data = resolve()
            if isinstance(data, torch.Tensor):
                storages.append(weakref.ref(data.untyped_storage()))
            return data

        return tracked

    def write_tracked(directory, items, resolvers):
        return write(directory, items, {k: tracking(f) for k, f in resolvers.items()})

    monkeypatch.setattr(importer, "_write_data", write_tracked)
    import_checkpoint(tiny.root / "hf", tmp_path / "mg", progress=False)
    assert len(storages) == N_MEGATRON_TENSORS  # one chunk each (the experts' too)
    assert max(held) == 0
    assert [r() for r in storages] == [None] * len(storages)


def test_import_at_an_iteration_in_bf16(tiny, tmp_path):
    s = import_checkpoint(
        tiny.root / "hf", tmp_path / "mg", iteration=7, dtype="bf16", progress=False
    )
    assert sorted(os.listdir(tmp_path / "mg")) == [
        "iter_0000007",
        "latest_checkpointed_iteration.txt",
    ]
    assert (tmp_path / "mg" / "latest_checkpointed_iteration.txt").read_text() == "7"
    assert s.extra["checkpoint_dir"] == f"{tmp_path / 'mg'}/iter_0000007"
    reader = DistCheckpointReader(tmp_path / "mg")
    assert reader.common_state()["iteration"] == 7
    dtypes = {k: reader.dtype(k) for k in reader.model_keys()}
    bias = "decoder.layers.1.mlp.router.expert_bias"
    assert dtypes.pop(bias) == F32
    assert set(dtypes.values()) == {torch.bfloat16}
    assert torch.equal(
        reader.read(bias),
        tiny.tensors["model.layers.1.block_sparse_moe.gate.e_score_correction_bias"],
    )
    assert s.largest_tensor_bytes == LARGEST * 2
    s = export_checkpoint(
        tmp_path / "mg", tmp_path / "out", dtype="fp32", tokenizer_dir=None, progress=False
    )
    assert s.largest_tensor_bytes == LARGEST * 4  # the fp32 HF tensor, not the bf16 one


@pytest.mark.parametrize("iteration", [-1, True, 1.5, "3"])
def test_import_refuses_an_iteration_that_is_not_an_integer_ge_0(tiny, tmp_path, iteration):
    with pytest.raises(ConversionError) as info:
        import_checkpoint(tiny.root / "hf", tmp_path / "mg", iteration=iteration, progress=False)
    assert str(info.value) == f"--iteration={iteration!r} is not allowed: an integer >= 0"
    assert os.listdir(tmp_path) == []


def test_import_of_a_tied_model_ignores_a_stored_lm_head(tmp_path):
    """A tied model's HF directory may hold ``lm_head.weight`` (a copy of the embedding): it is
    ignored, not refused; the imported checkpoint has no output layer."""
    arch = ModelArch(**dict(TINY, tie_embeddings=True))
    write_hf_dir(tmp_path / "hf", arch, extra={"lm_head.weight": torch.zeros(96, 16)})
    s = import_checkpoint(tmp_path / "hf", tmp_path / "mg", progress=False)
    assert s.tensors == N_CHECKPOINT_KEYS - 1
    assert "output_layer.weight" not in DistCheckpointReader(tmp_path / "mg").model_keys()


# ------------------------------------------------------------------------- import refusals
def _import_fails(src, out, message):
    with pytest.raises(ConversionError) as info:
        import_checkpoint(src, out, progress=False)
    assert str(info.value) == message
    assert not os.path.exists(out) and no_leftovers(os.path.dirname(out))


def test_import_refuses_a_directory_without_config_or_weights(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    _import_fails(hf, tmp_path / "mg", f"HF model directory {str(hf)!r} has no config.json")
    (hf / "config.json").write_text(
        json.dumps(dict(model_type="stable_latentmoe", **ModelArch(**TINY).to_hf_config_kwargs()))
    )
    _import_fails(
        hf,
        tmp_path / "mg",
        f"HF model directory {str(hf)!r} has neither {INDEX_FILE} nor model.safetensors",
    )


def test_a_binary_config_file_is_refused_naming_it(tmp_path):
    """A weights shard given as --megatron-config (or as an HF directory's config.json): one
    ConversionError naming the file, where reading it was a UnicodeDecodeError traceback."""
    from megatron_latentmoe.convert.arch import read_config_file

    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\x08\x80\xff")
    with pytest.raises(ConversionError) as e:
        read_config_file(path)
    assert str(e.value) == (
        f"config file {str(path)!r} is not a UTF-8 text file: 'utf-8' codec can't decode byte "
        "0x80 in position 1: invalid start byte"
    )


def _one_tensor_file(hf, header: dict, data: bytes = bytes(16)) -> None:
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    (hf / "model.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def test_import_refuses_safetensors_it_cannot_read(tmp_path):
    hf = tmp_path / "hf"
    write_hf_dir(hf, ModelArch(**TINY))
    f = hf / "model.safetensors"
    name = "model.embed_tokens.weight"
    _one_tensor_file(hf, {name: {"dtype": "I32", "shape": [2, 2], "data_offsets": [0, 16]}})
    _import_fails(
        hf,
        tmp_path / "mg",
        f"{str(f)!r}: tensor {name!r} has dtype I32: not a supported float type "
        "(F32, BF16, F16, F64)",
    )
    _one_tensor_file(hf, {name: {"dtype": "U8", "shape": [2, 2], "data_offsets": [0, 4]}})
    _import_fails(
        hf,
        tmp_path / "mg",
        f"{str(f)!r}: tensor {name!r} has dtype U8: not a supported float type "
        "(F32, BF16, F16, F64)",
    )
    for offsets, data in (([0, 12], bytes(16)), ([0, 16], bytes(15))):
        _one_tensor_file(
            hf, {name: {"dtype": "F32", "shape": [2, 2], "data_offsets": offsets}}, data
        )
        _import_fails(
            hf,
            tmp_path / "mg",
            f"{str(f)!r}: tensor {name!r} has inconsistent offsets (truncated or corrupt file)",
        )
    f.write_bytes(struct.pack("<Q", 9) + b"{}" + bytes(6))
    _import_fails(
        hf,
        tmp_path / "mg",
        f"safetensors file {str(f)!r} cannot be read: header longer than the file",
    )
    packed = "model.layers.1.block_sparse_moe.experts.0.w1.weight_packed"
    _one_tensor_file(hf, {packed: {"dtype": "U8", "shape": [2, 2], "data_offsets": [0, 4]}})
    _import_fails(
        hf,
        tmp_path / "mg",
        f"{str(hf)!r}: uint8 tensor(s) [{packed!r}] but config.json has no MXFP4 "
        "quantization_config",
    )


def test_import_refuses_an_index_naming_the_wrong_file(tmp_path):
    hf = tmp_path / "hf"
    tensors = write_hf_dir(hf, ModelArch(**TINY))
    (hf / "model.safetensors").rename(hf / "a.safetensors")
    save_file({"x": torch.zeros(1)}, str(hf / "b.safetensors"))
    names = sorted(tensors)
    weight_map = {n: "a.safetensors" for n in names}
    weight_map[names[0]] = weight_map[names[1]] = "b.safetensors"
    (hf / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    _import_fails(
        hf,
        tmp_path / "mg",
        f"{str(hf / INDEX_FILE)!r} names tensor(s) not found in their files: {names[:2]!r}",
    )


def test_import_at_iteration_0(tiny, tmp_path):
    import_checkpoint(tiny.root / "hf", tmp_path / "mg", iteration=0, progress=False)
    assert (tmp_path / "mg" / "latest_checkpointed_iteration.txt").read_text() == "0"
    assert DistCheckpointReader(tmp_path / "mg").common_state()["iteration"] == 0
    assert sorted(os.listdir(tmp_path / "mg")) == [
        "iter_0000000",
        "latest_checkpointed_iteration.txt",
    ]


def test_outputs_that_would_replace_an_input_are_refused_before_anything_is_read(tiny, tmp_path):
    """The output is checked first: an existing output is refused even when the input is bad; an
    output that is (or holds) the input is refused with --overwrite too, and the input stays."""
    mg, hf = tiny.root / "mg", tiny.root / "hf"
    before = sorted(tiny.root.rglob("*"))
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    exists = (
        f"output directory {str(out)!r} exists and is not empty; pass --overwrite to replace it"
    )
    for convert in (export_checkpoint, import_checkpoint):
        with pytest.raises(ConversionError) as info:
            convert(tmp_path / "missing", out, progress=False)
        assert str(info.value) == exists
    for convert, src, output, flag, named in (
        (export_checkpoint, mg, mg / "release", "--checkpoint", mg / "release"),  # the iteration
        (export_checkpoint, mg / "release", mg, "--checkpoint", mg / "release"),
        (import_checkpoint, hf, hf, "--hf", hf),
        (import_checkpoint, hf, tiny.root, "--hf", hf),
    ):
        with pytest.raises(ConversionError) as info:
            convert(src, output, overwrite=True, progress=False)
        assert str(info.value) == (
            f"--output {str(output)!r} would replace the input {flag} {str(named)!r} (it is that "
            "directory or contains it); allowed: an output directory outside the input"
        )
    assert sorted(tiny.root.rglob("*")) == before


def test_import_refuses_hf_directories_that_do_not_match_their_config(tmp_path):
    arch = ModelArch(**TINY)
    missing = tmp_path / "nothing"
    _import_fails(missing, tmp_path / "mg", f"HF model directory {str(missing)!r} does not exist")
    # a tensor the config does not describe, or one of the wrong shape (named with both shapes)
    for name, extra, problem in (
        (
            "hf",
            {"model.layers.9.mlp.up_proj.weight": torch.zeros(1)},
            "unexpected tensor(s) not described by config.json (1): "
            "['model.layers.9.mlp.up_proj.weight']",
        ),
        (
            "hf_shape",
            {"model.norm.weight": torch.zeros(17)},
            f"{tmp_path / 'hf_shape'}: tensor 'model.norm.weight' shape=(17,) is not allowed: "
            "(16,), what the model config implies",
        ),
    ):
        hf = tmp_path / name
        write_hf_dir(hf, arch, extra=extra)
        message = f"HF checkpoint {str(hf)!r} does not match its config.json:\n  {problem}"
        _import_fails(hf, tmp_path / "mg", message)
    save_file({"x": torch.zeros(1)}, str(hf / "model.safetensors"))
    with pytest.raises(ConversionError) as info:
        import_checkpoint(hf, tmp_path / "mg", progress=False)
    lines = str(info.value).splitlines()
    assert len(lines) == 1 + 12 + 1 and lines[-1] == "  ... and 27 more"  # 12 of 39 problems
    assert lines[1:3] == [
        "  missing tensor 'model.embed_tokens.weight'",
        "  missing tensor 'model.layers.0.input_layernorm.weight'",
    ]
    shapes = dict(hf for tm in iter_tensor_maps(arch) for hf in tm.hf)
    kept = {name: torch.zeros(shape) for name, shape in list(shapes.items())[11:]}
    save_file({**kept, "x": torch.zeros(1)}, str(hf / "model.safetensors"))
    with pytest.raises(ConversionError) as info:
        import_checkpoint(hf, tmp_path / "mg", progress=False)
    lines = str(info.value).splitlines()  # 11 missing + 1 unexpected: all shown, no "0 more"
    assert len(lines) == 1 + 12 and lines[-1].startswith("  unexpected tensor(s)")
    (hf / INDEX_FILE).write_text(json.dumps({"weight_map": {"x": "model-00002.safetensors"}}))
    _import_fails(
        hf,
        tmp_path / "mg",
        f"safetensors file {str(hf / 'model-00002.safetensors')!r} (named by the index) is missing",
    )


def test_a_safetensors_file_truncated_while_read_is_an_error(tmp_path):
    from megatron_latentmoe.convert.importer import SafetensorsFile

    path = tmp_path / "model.safetensors"
    save_file({"w": torch.arange(8.0).reshape(4, 2)}, str(path))
    f = SafetensorsFile(path)
    try:
        assert torch.equal(f.read_rows("w", 1, 3), torch.tensor([[2.0, 3.0], [4.0, 5.0]]))
        os.truncate(path, os.path.getsize(path) - 8)
        with pytest.raises(ConversionError) as info:
            f.read_rows("w", 2, 4)
        assert str(info.value) == f"{str(path)!r}: unexpected end of file reading 'w'"
    finally:
        f.close()


def test_mxfp4_export_reads_back_in_the_dense_dtype(tiny, tmp_path):
    """``--expert-dtype mxfp4`` in bf16: every routed expert linear becomes a uint8
    ``weight_packed`` [out, in/2] + ``weight_scale`` [out, in/32] pair; the import dequantizes
    them into bf16, the dtype of the other (non-fp32) tensors."""
    from megatron_latentmoe.convert import mxfp4

    s = export_checkpoint(
        tiny.root / "mg",
        tmp_path / "hf",
        dtype="bf16",
        expert_dtype="mxfp4",
        tokenizer_dir=None,
        progress=False,
    )
    # 4 experts x 3 linears [32, 32]: 32 x 16 codes + 32 x 1 scales
    assert (s.extra["expert_dtype"], s.extra["routed_expert_bytes"]) == ("mxfp4", 12 * 544)
    assert s.tensors == N_HF_TENSORS + 12
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["quantization_config"] == mxfp4.quantization_config()
    back = hf_tensors(tmp_path / "hf")
    w1 = "model.layers.1.block_sparse_moe.experts.2.w1"
    assert f"{w1}.weight" not in back
    packed, scale = back[f"{w1}.weight_packed"], back[f"{w1}.weight_scale"]
    assert (packed.dtype, packed.shape, scale.dtype, scale.shape) == (
        torch.uint8,
        (32, 16),
        torch.uint8,
        (32, 1),
    )
    import_checkpoint(tmp_path / "hf", tmp_path / "mg", progress=False)
    reader = DistCheckpointReader(tmp_path / "mg")
    fc1 = "decoder.layers.1.mlp.experts.experts.linear_fc1.weight"
    assert reader.dtype(fc1) == torch.bfloat16
    dense = mxfp4.unpack(f"{w1}.weight", back, torch.bfloat16)
    assert torch.equal(reader.read(fc1)[2, :32], dense)  # w1 is the first half of fc1


def test_mxfp4_import_of_an_fp32_export_and_of_a_pair_missing_half(tiny, tmp_path):
    """An fp32 MXFP4 export is read back in fp32 (no other dense dtype to follow); a
    ``weight_packed`` without its ``weight_scale`` (or the reverse) is one error naming it."""
    from megatron_latentmoe.convert import mxfp4

    hf = tmp_path / "hf"
    export_checkpoint(
        tiny.root / "mg", hf, expert_dtype="mxfp4", tokenizer_dir=None, progress=False
    )
    import_checkpoint(hf, tmp_path / "mg", progress=False)
    back = hf_tensors(hf)
    w1 = "model.layers.1.block_sparse_moe.experts.2.w1"
    fc1 = DistCheckpointReader(tmp_path / "mg").read(
        "decoder.layers.1.mlp.experts.experts.linear_fc1.weight", (2,)
    )
    assert fc1.dtype == F32 and torch.equal(fc1[:32], mxfp4.unpack(f"{w1}.weight", back, F32))
    for f in os.listdir(hf):
        if f.endswith(".safetensors") or f == INDEX_FILE:
            os.remove(hf / f)
    for dropped in ("weight_scale", "weight_packed"):
        kept = {k: v for k, v in back.items() if k != f"{w1}.{dropped}"}
        save_file(kept, str(hf / "model.safetensors"))
        missing = f"{w1}.weight_scale"  # the packed tensor's pair, or the scale left alone
        _import_fails(
            hf, tmp_path / "mg2", f"{str(hf)!r}: MXFP4 tensors without their pair: {[missing]!r}"
        )


def test_fp16_import_of_values_beyond_its_range_is_refused(tmp_path):
    """``import --dtype fp16`` of an HF weight beyond fp16's 65504: one error naming the option,
    the tensor and its largest value, and no output (it was written as inf, silently); bf16
    holds it."""
    big = {"model.layers.0.mlp.up_proj.weight": torch.full((24, 16), -1e5)}
    write_hf_dir(tmp_path / "hf", ModelArch(**TINY), extra=big)
    with pytest.raises(ConversionError) as info:
        import_checkpoint(tmp_path / "hf", tmp_path / "mg", dtype="fp16", progress=False)
    assert str(info.value) == (
        "dtype='fp16' is not allowed: bf16 or fp32 for this checkpoint: "
        "'decoder.layers.0.mlp.linear_fc1.weight' holds |values| up to 1e+05, above fp16's "
        "largest, 65504"
    )
    assert os.listdir(tmp_path) == ["hf"]
    import_checkpoint(tmp_path / "hf", tmp_path / "mg", dtype="bf16", progress=False)
    fc1 = DistCheckpointReader(tmp_path / "mg").read("decoder.layers.0.mlp.linear_fc1.weight")
    assert fc1.dtype == torch.bfloat16 and fc1[24:].eq(-1e5).all()  # up_proj: the second half


def test_a_non_finite_expert_bias_is_refused_by_import_and_export(tmp_path, monkeypatch):
    """NaN / inf in an expert bias (``e_score_correction_bias`` / ``router.expert_bias``): import
    and export each stop with one error naming the tensor and the experts, and write nothing
    (converted, a NaN bias is every token's top choice; training refuses it at load)."""
    from megatron_latentmoe.convert import importer

    arch = ModelArch(**TINY)
    bias = next(tm for tm in iter_tensor_maps(arch) if tm.fp32 and not tm.zeros)
    (hf_name, shape), *_ = bias.hf
    bad = torch.zeros(shape)
    bad[1], bad[3] = float("nan"), float("-inf")
    write_hf_dir(tmp_path / "hf", arch, extra={hf_name: bad})
    why = "allowed: finite values (a corrupt checkpoint: convert an earlier one)"
    _import_fails(
        tmp_path / "hf",
        tmp_path / "mg",
        f"{hf_name} = [nan, -inf] at expert(s) [1, 3] (2 of {shape[0]}); {why}",
    )
    # a Megatron checkpoint holding such a bias (written past the import's check) is not exported
    monkeypatch.setattr(importer, "checked_bias", lambda name, t, tm: t)
    import_checkpoint(tmp_path / "hf", tmp_path / "mg", progress=False)
    with pytest.raises(ConversionError) as info:
        export_checkpoint(tmp_path / "mg", tmp_path / "out", tokenizer_dir=None, progress=False)
    assert str(info.value) == (
        f"{bias.megatron} = [nan, -inf] at expert(s) [1, 3] (2 of {shape[0]}); {why}"
    )
    assert not os.path.exists(tmp_path / "out") and no_leftovers(tmp_path)
