"""The converter's verification, checkpoint reader, summary and command line, number by number.

Fast tests (no Megatron world, no workspace): ``verify.py``'s comparison, verdict and report on
given logits / fake models, ``dist_reader.py`` on small DCP checkpoints saved here,
``summary.py``'s figures, and ``cli.py``'s plumbing with the conversions replaced by recorders.
One slow test runs the real ``verify`` on an export with one weight changed: it must FAIL.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron_latentmoe.convert import ConversionError, cli, summary, verify
from megatron_latentmoe.convert.dist_reader import DistCheckpointReader

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_report(max_d=5e-6, same=True, **kw) -> verify.VerifyReport:
    return verify.VerifyReport(
        max_d,
        1e-6,
        1.0,
        "real text",
        (2, 64),
        32,
        same,
        **dict(
            dict(
                min_margin=1e-2,
                first_mismatch=None if same else 3,
                megatron_margin_at_mismatch=None if same else 1e-7,
                hf_margin_at_mismatch=None if same else 2e-7,
            ),
            **kw,
        ),
    )


# ------------------------------------------------------------------------ checkpoint reader (DCP)
def save_dcp(path, tensors: dict, metadata_json=None) -> DistCheckpointReader:
    """A one-process ``torch_dist``-style DCP checkpoint of ``tensors``, opened."""
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
    if metadata_json is not None:
        (path / "metadata.json").write_text(json.dumps(metadata_json))
    return DistCheckpointReader(path)


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "decoder.final_layernorm.weight": torch.randn(6, generator=g),
        "decoder.layers.mlp.linear_fc1.weight": torch.randn(2, 3, 4, generator=g).bfloat16(),
        "decoder.layers.fp8": torch.randn(3, 5, generator=g).to(torch.float8_e4m3fn),
        "embedding.word_embeddings.weight": torch.randn(5, 4, generator=g),
        "optimizer.state.exp_avg": torch.randn(2, generator=g),
        "optimizer.step": torch.tensor(3.0),
    }
    path = tmp_path_factory.mktemp("dcp") / "ck"
    save_dcp(path, tensors, {"sharded_backend": "torch_dist"})
    return path, tensors


def test_reader_refuses_regions_outside_the_tensor(small_ckpt):
    r = DistCheckpointReader(small_ckpt[0])
    key = "decoder.layers.mlp.linear_fc1.weight"

    def refusal(key, lead):
        with pytest.raises(ConversionError) as info:
            r.read(key, lead)
        return str(info.value)

    assert refusal(key, (2,)) == (
        f"tensor {key!r} of shape (2, 3, 4): index 2 out of range on axis 0"
    )
    assert refusal(key, (-1,)) == (
        f"tensor {key!r} of shape (2, 3, 4): index -1 out of range on axis 0"
    )
    assert refusal(key, (1, 3)) == (
        f"tensor {key!r} of shape (2, 3, 4): index 3 out of range on axis 1"
    )
    assert refusal(key, (0, 0, 0)) == (
        f"tensor {key!r} of shape (2, 3, 4) has no axis after (0, 0, 0)"
    )
    assert refusal("nope", ()) == f"checkpoint {str(small_ckpt[0])!r} has no tensor 'nope'"
    assert refusal("optimizer.step", (0,)) == (
        "tensor 'optimizer.step' of shape () has no axis after (0,)"
    )
    assert r.read("optimizer.step").tolist() == 3.0  # a scalar reads whole
    assert r.read(key, (1, 2)).shape == (4,)  # the last indices that exist
    assert r.bytes_read == 8 + 4


# -------------------------------------------------------------------------------- command line
class Recorder:
    """Stands in for a conversion or ``verify_export``: records its call, returns ``result``."""

    def __init__(self, result):
        self.result, self.calls = result, []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        if isinstance(self.result, BaseException):
            raise self.result
        return self.result


@pytest.fixture
def recorders(monkeypatch):
    from megatron_latentmoe.convert import export, importer

    out = {}
    for module, name, result in (
        (export, "export_checkpoint", summary.ConversionSummary("export", "a", "b", seconds=2.0)),
        (importer, "import_checkpoint", summary.ConversionSummary("import", "c", "d", seconds=1.0)),
        (verify, "verify_export", make_report()),
    ):
        out[name] = Recorder(result)
        monkeypatch.setattr(module, name, out[name])
    return out


def test_cli_refuses_a_summary_json_that_is_a_directory(recorders, tmp_path, capsys):
    """Before the conversion, not after it (``os.replace`` onto a directory: a traceback, and the
    temporary file left beside it)."""
    reports = tmp_path / "reports"
    reports.mkdir()
    argv = ["export", "--checkpoint", "ck", "--output", "hf", "--summary-json", str(reports)]
    assert cli.main(argv) == cli.EXIT_BAD_INPUT
    assert capsys.readouterr().err == (
        f"error: --summary-json={str(reports)!r} is not allowed: a file path, not a directory\n"
    )
    assert recorders["export_checkpoint"].calls == []
    assert os.listdir(tmp_path) == ["reports"] and os.listdir(reports) == []
