"""``--verify``: run the Megatron model and the exported HF model on the same tokens and compare.

* Megatron side: ``build_gpt_model`` (local spec, fp32, one process, TP = EP = PP = 1) with the
  weights loaded from the ``torch_dist`` checkpoint by Megatron's own ``dist_checkpointing.load``
  (with MXFP4 QAT of the routed experts when the export is MXFP4: training's forward)
  (an independent path from the converter's reader, so a mapping bug cannot cancel out). It runs
  where Megatron expects to run: on the GPU when CUDA is present (Megatron's router moves its
  weight to the current CUDA device), else on the CPU with the CPU shims.
* HF side: ``AutoModelForCausalLM.from_pretrained(export_dir, trust_remote_code=True,
  dtype=float32)`` -- the files a user downloads, the remote code included.
* Tokens: real text from the shipped corpus, tokenised by the exported tokenizer (falls back to
  seeded random ids, reported, if the tokenizer's ids do not fit the model's vocabulary), or the
  ``--verify-text`` given (refused, never replaced, if its ids do not fit).

Reported: max |delta logits|, mean |delta|, cosine similarity of the flattened logits, and whether
greedy generation of N tokens (Megatron: full re-forward each step; HF: ``generate`` with its KV
cache) gives the same tokens; at the first difference, the top-1/top-2 margin of both models
(a tiny margin means a near-tie flipped by round-off, not a conversion bug).
Both models run in fp32. Where one side stores a tensor in a narrower dtype than the other (an
fp32 checkpoint exported with ``--dtype bf16``, an fp32 HF model imported in bf16), the other
side's copy is rounded to that dtype first, as the conversion rounded it, so a bf16 export is
compared exactly too (reported; MXFP4 experts are compared as QAT computes them).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass, field

import torch

from megatron_latentmoe.fields import not_allowed

from .arch import ModelArch
from .dist_reader import DistCheckpointReader, open_checkpoint
from .errors import ConversionError
from .names import TRAINING_STATE_SUFFIXES, iter_tensor_maps
from .options import (
    DEFAULT_ATOL,
    DEFAULT_VERIFY_BATCH,
    DEFAULT_VERIFY_SEQ_LEN,
    DEFAULT_VERIFY_TOKENS,
)


@dataclass
class VerifyReport:
    max_abs_diff: float
    mean_abs_diff: float
    cosine: float
    tokens_source: str
    batch_shape: tuple
    new_tokens: int
    greedy_identical: bool
    min_margin: float = float("nan")
    """Smallest top-1 minus top-2 logit over the Megatron greedy steps (near-tie detector)."""
    first_mismatch: int | None = None
    megatron_margin_at_mismatch: float | None = None
    hf_margin_at_mismatch: float | None = None
    megatron_tokens: list = field(default_factory=list)
    hf_tokens: list = field(default_factory=list)
    atol: float = DEFAULT_ATOL
    seconds: float = 0.0
    precision: str = ""
    """Which side's weights were rounded to the other's stored dtype ('' if none)."""

    @property
    def passed(self) -> bool:
        return (
            self.max_abs_diff <= self.atol
            and self.greedy_identical
            and math.isfinite(self.max_abs_diff)
        )

    def format(self) -> str:
        lines = [
            f"verify ({self.tokens_source}, batch {list(self.batch_shape)}):",
            *([f"  {self.precision}"] if self.precision else []),
            f"  logits max |delta| = {self.max_abs_diff:.3e} (tolerance {self.atol:.1e})   "
            f"mean |delta| = {self.mean_abs_diff:.3e}   cosine = {self.cosine:.9f}",
            f"  greedy generation of {self.new_tokens} tokens: "
            + (
                f"identical (smallest top-1/top-2 logit margin {self.min_margin:.3e})"
                if self.greedy_identical
                else f"DIFFERS at step {self.first_mismatch} (top1-top2 margin: Megatron "
                f"{self.megatron_margin_at_mismatch:.3e}, HF {self.hf_margin_at_mismatch:.3e})"
            ),
            f"  result: {'PASS' if self.passed else 'FAIL'}   ({self.seconds:.1f} s)",
        ]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["passed"] = self.passed
        return out


# ------------------------------------------------------------------------------ Megatron side


def _ensure_single_process_world() -> None:
    """A 1-process world (NCCL with CUDA, else gloo) + Megatron's parallel state (TP = EP = PP = 1)
    if none exists."""
    import torch.distributed as dist

    os.environ.setdefault("NO_VCS_VERSION", "1")
    if not dist.is_initialized():  # an in-memory store: one process, nothing left on disk
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    from megatron.core import parallel_state

    from megatron_latentmoe.compat import apply_cpu_compat, initialize_parallel_cpu

    if not parallel_state.model_parallel_is_initialized():
        initialize_parallel_cpu()
    else:
        apply_cpu_compat()


def load_megatron_model(
    checkpoint: str | os.PathLike, arch: ModelArch, expert_weight_qat: str = "none"
):
    """The fp32 single-process Megatron model with the checkpoint's weights (Megatron's loader),
    ``expert_weight_qat`` as in training (``moe_expert_weight_qat``)."""
    _ensure_single_process_world()
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from megatron_latentmoe.model import build_gpt_model
    from megatron_latentmoe.moe.layer import use_legacy_names_of

    reader = DistCheckpointReader(checkpoint)
    path = reader.path
    config = arch.to_megatron_config(
        perform_initialization=False, moe_expert_weight_qat=expert_weight_qat
    )
    model = build_gpt_model(config, **arch.builder_kwargs())
    model.eval()
    present = set(reader.metadata.state_dict_metadata)
    use_legacy_names_of(model, present)  # a checkpoint from before the latent norm's rename
    sharded = model.sharded_state_dict()
    for name, sh in list(sharded.items()):
        # local-spec linears' extra state is None (not saved); a TE save has its own
        if isinstance(sh, ShardedObject) and sh.unique_key not in present:
            if name.endswith("_extra_state"):
                del sharded[name]
        # training state (QB rescoring's mean router input): unused here, and checkpoints
        # written before it was saved lack it
        elif name.endswith(TRAINING_STATE_SUFFIXES):
            del sharded[name]
    loaded = dist_checkpointing.load(sharded, str(path))
    own = set(model.state_dict())
    loaded = {k: v for k, v in loaded.items() if k in own}  # drop the common state (args, ...)
    from megatron_latentmoe.moe.router import NonFiniteBiasError

    try:
        missing, unexpected = model.load_state_dict(loaded, strict=False)
    except NonFiniteBiasError as err:  # a corrupt router bias, named
        raise ConversionError(f"Megatron model load: {err}") from None
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ConversionError(
            f"Megatron model load: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    from megatron_latentmoe.moe.router import megatron_device

    return model.to(megatron_device())


@torch.no_grad()
def megatron_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """fp32 logits [b, s, vocab] on the CPU, whatever device the model runs on."""
    from megatron_latentmoe.moe.router import megatron_device

    b, s = tokens.shape
    device = megatron_device()
    position_ids = torch.arange(s, dtype=torch.long, device=device)[None].expand(b, s)
    return model(tokens.to(device), position_ids, None).float().cpu()


def _margin(logits: torch.Tensor) -> float:
    """Smallest top-1 minus top-2 logit over the batch."""
    top2 = logits.float().topk(2, dim=-1).values
    return float((top2[:, 0] - top2[:, 1]).min())


@torch.no_grad()
def megatron_greedy(model, tokens: torch.Tensor, n: int) -> tuple[torch.Tensor, list[float]]:
    """Greedy continuation (full re-forward per step); returns new ids [b, n] and per-step
    margins."""
    seq, margins = tokens, []
    for _ in range(n):
        last = megatron_logits(model, seq)[:, -1]
        margins.append(_margin(last))
        seq = torch.cat([seq, last.argmax(-1, keepdim=True)], dim=1)
    return seq[:, tokens.shape[1] :], margins


# ----------------------------------------------------------------------------------- HF side


def load_hf_model(hf_dir: str | os.PathLike):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(hf_dir), trust_remote_code=True, dtype=torch.float32
    )
    model.eval()
    return model


@torch.no_grad()
def hf_greedy(model, tokens: torch.Tensor, n: int) -> tuple[torch.Tensor, list[float]]:
    out = model.generate(
        tokens,
        attention_mask=torch.ones_like(tokens),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        num_beams=1,
        eos_token_id=None,
        pad_token_id=model.config.pad_token_id,
        output_scores=True,
        return_dict_in_generate=True,
    )
    return out.sequences[:, tokens.shape[1] :], [_margin(scores) for scores in out.scores]


# ------------------------------------------------------------------------------------ tokens


def sample_tokens(
    hf_dir: str | os.PathLike,
    vocab_size: int,
    batch: int = DEFAULT_VERIFY_BATCH,
    seq_len: int = DEFAULT_VERIFY_SEQ_LEN,
    text: str | None = None,
) -> tuple[torch.Tensor, str]:
    """[batch, seq_len] token ids of real text (tokenised by the export's tokenizer). Without a
    usable tokenizer, seeded random ids (said in the returned source); an explicit ``text`` that
    cannot give ``seq_len`` tokens of the vocabulary raises :class:`ConversionError`
    (:func:`verify_text_ids`): the prompt the user asked for, or none."""
    if text:
        rows = [verify_text_ids(hf_dir, text, seq_len, vocab_size)] * batch
        return torch.tensor(rows, dtype=torch.long), "real text, exported tokenizer"
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(hf_dir), trust_remote_code=True)
        rows = []
        for t in _corpus_texts(batch, seq_len):
            ids = tok(t, add_special_tokens=False)["input_ids"]
            if len(ids) < seq_len:
                raise ValueError("text too short")
            rows.append(ids[:seq_len])
        tokens = torch.tensor(rows, dtype=torch.long)
        if int(tokens.max()) < vocab_size:
            return tokens, "real text, exported tokenizer"
        reason = f"tokenizer ids up to {int(tokens.max())} exceed vocab_size={vocab_size}"
    except Exception as e:  # noqa: BLE001 - no tokenizer / too short text: fall back, and say so
        from megatron_latentmoe.data.hf_tokenizer import TOKENIZER_FILES, one_line

        reason = f"no usable tokenizer/text ({type(e).__name__}: {one_line(e)})"
        if not any(os.path.isfile(os.path.join(hf_dir, f)) for f in TOKENIZER_FILES):
            # an export with --tokenizer none: not transformers' five lines on slow tokenizers
            reason = f"no tokenizer in {os.fspath(hf_dir)!r}: no {' nor '.join(TOKENIZER_FILES)}"
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (batch, seq_len), generator=g), f"random ids ({reason})"


def verify_text_ids(
    tokenizer_dir: str | os.PathLike | None, text: str, seq_len: int, vocab_size: int
) -> list:
    """The prompt of an explicit ``--verify-text``: its first ``seq_len`` token ids under the
    tokenizer in ``tokenizer_dir`` (the export's; None: ``--tokenizer none``). Raises
    :class:`ConversionError` naming --verify-text, in one line, if no tokenizer loads from there,
    the text gives fewer than ``seq_len`` tokens or one of them is not below ``vocab_size`` (the
    model's: the comparison fell back to random ids, the text asked for unused). The conversions
    call it with the tokenizer they ship (export) or read (import) before their output is begun:
    ``import --verify --verify-text 'Hi'`` (and an export with ``--tokenizer none``) wrote the
    whole output and was refused only then, the latter in the tokenizer's many-line message."""
    allowed = f"allowed: a text of at least {seq_len} tokens (--verify-seq-len)"
    if tokenizer_dir is None:
        raise ConversionError(
            f"--verify-text {_preview(text)}: the export ships no tokenizer (--tokenizer none) to "
            f"give its tokens; {allowed}, with a tokenizer shipped, or no --verify-text"
        )
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), trust_remote_code=True)
    except Exception as e:  # noqa: BLE001 - any load failure: the text has no tokens
        raise ConversionError(
            f"--verify-text {_preview(text)}: no tokenizer loads from {str(tokenizer_dir)!r} "
            f"({type(e).__name__}); {allowed} under a tokenizer that loads, or no --verify-text"
        ) from None
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if len(ids) < seq_len:
        raise ConversionError(
            f"--verify-text {_preview(text)} gives {len(ids)} tokens under the tokenizer of "
            f"{str(tokenizer_dir)!r}; {allowed}"
        )
    prompt = ids[:seq_len]
    if max(prompt) >= vocab_size:
        raise ConversionError(
            f"--verify-text {_preview(text)} gives token id {max(prompt)} under the tokenizer of "
            f"{str(tokenizer_dir)!r}, outside the model's vocab_size={vocab_size}; allowed: a "
            f"text whose first {seq_len} tokens (--verify-seq-len) are ids below {vocab_size}, "
            "or no --verify-text"
        )
    return prompt


def _preview(text: str, n: int = 40) -> str:
    return repr(text if len(text) <= n else text[:n] + "...")


def _corpus_texts(batch: int, seq_len: int) -> list[str]:
    from megatron_latentmoe.data.corpus import iter_corpus_texts

    out = []
    for t in iter_corpus_texts():
        if len(out) >= batch:
            break
        if len(t) >= 8 * seq_len:
            out.append(t)
    return out


# ------------------------------------------------------------------------------------- verify


def compare_logits(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, float]:
    d = (a.double() - b.double()).abs()
    cos = torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0)
    return float(d.max()), float(d.mean()), float(cos)


def check_verify_options(
    *, atol: float, new_tokens: int, batch: int, seq_len: int, text: str | None = None
) -> None:
    """Raise :class:`ConversionError` naming the option (and its flag) if a verify setting is out
    of range."""
    if text is not None and not text.strip():
        raise not_allowed(
            "text (--verify-text)", text, "a non-empty text (default: the corpus)", ConversionError
        )
    for name, flag, value in (
        ("new_tokens", "--verify-tokens", new_tokens),
        ("batch", "--verify-batch", batch),
        ("seq_len", "--verify-seq-len", seq_len),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise not_allowed(f"{name} ({flag})", value, "an integer >= 1", ConversionError)
    if not (isinstance(atol, (int, float)) and math.isfinite(atol) and atol > 0):
        raise not_allowed("atol (--verify-atol)", atol, "a positive finite number", ConversionError)


def check_verify_length(arch: ModelArch, seq_len: int, new_tokens: int) -> None:
    """Raise :class:`ConversionError` naming --verify-seq-len and --verify-tokens if the prompt
    and the greedy tokens after it are longer than the model's max_position_embeddings
    (Megatron's max_sequence_length): the audit's ``verify --verify-seq-len 100000`` was an
    out-of-memory RuntimeError traceback from the attention, and a prompt at the limit compared
    the generated tokens at positions the model was not built for, silently (measured: the test
    model's 256 positions, ``--verify-seq-len 256 --verify-tokens 8``: PASS, with transformers'
    "exceeded the model's predefined maximum length" reminder alone)."""
    limit, total = arch.max_position_embeddings, seq_len + new_tokens
    if total > limit:
        raise ConversionError(
            f"--verify-seq-len {seq_len} + --verify-tokens {new_tokens} = {total} tokens is not "
            f"allowed: at most {limit}, the model's max_position_embeddings (max_sequence_length): "
            "the greedy tokens continue the prompt"
        )


def hf_expert_weight_qat(hf_dir: str | os.PathLike) -> str:
    """``"mxfp4"`` if the export's routed experts are MXFP4 (``convert/mxfp4.py``), else
    ``"none"``: the ``moe_expert_weight_qat`` under which Megatron computes what the export does."""
    import json

    from . import mxfp4

    with open(os.path.join(hf_dir, "config.json")) as f:
        return "mxfp4" if mxfp4.is_mxfp4(json.load(f).get("quantization_config")) else "none"


@torch.no_grad()
def match_stored_precision(
    mg, hf, arch: ModelArch, reader: DistCheckpointReader, hf_dir, *, mxfp4_experts: bool
) -> str:
    """Round each side's fp32 copy of a tensor to the dtype the other side stores it in (a no-op
    where both store the same dtype), so the logits compare the conversion and not the rounding
    that ``--dtype`` asked for. The fp32 expert bias and MXFP4 routed experts (both sides compute
    them from the same MXFP4 values) are left as they are. Returns what was rounded, for the
    report ('' if nothing)."""
    from .importer import HFCheckpointReader

    mg_params, hf_params = dict(mg.named_parameters()), dict(hf.named_parameters())
    rounded: dict[str, set[str]] = {"Megatron": set(), "HF": set()}
    hfr = HFCheckpointReader(hf_dir)
    try:
        in_files = hfr.tensor_names()
        for tm in iter_tensor_maps(arch):
            if tm.fp32 or tm.zeros or (mxfp4_experts and tm.expert is not None):
                continue
            if tm.hf[0][0] not in in_files:  # not this model's files: the logits will say so
                continue
            mg_dtype = reader.dtype(reader.locate(tm).keys[0])
            hf_dtype = hfr.dtype(tm.hf[0][0])
            for side, params, names, dtype, own in (
                ("Megatron", mg_params, (tm.megatron,), hf_dtype, mg_dtype),
                ("HF", hf_params, tm.hf_names, mg_dtype, hf_dtype),
            ):
                if dtype in (torch.float32, own):
                    continue
                for p in (params[name] for name in names if name in params):
                    p.copy_(p.to(dtype).to(p.dtype))
                rounded[side].add(str(dtype).replace("torch.", ""))
    finally:
        hfr.close()
    return "; ".join(
        f"{side} weights rounded to {'/'.join(sorted(dts))} (as the "
        f"{'HF files store' if side == 'Megatron' else 'Megatron checkpoint stores'} them)"
        for side, dts in rounded.items()
        if dts
    )


def check_hf_dir(hf_dir: str | os.PathLike) -> None:
    """Raise :class:`ConversionError` unless ``hf_dir`` is a directory with a ``config.json``."""
    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        raise ConversionError(
            f"HF directory {str(hf_dir)!r} has no config.json (not an HF model directory)"
        )


def check_hf_files(hf_dir: str | os.PathLike) -> None:
    """Raise :class:`ConversionError` naming the file if the HF directory's weights cannot be read
    (a shard missing, cut short or garbled; an index naming absent tensors), from their headers
    alone: ``from_pretrained`` raised a SafetensorError / OSError traceback there, after the
    Megatron model was loaded (measured: a model.safetensors of 1000 bytes)."""
    from .importer import HFCheckpointReader

    HFCheckpointReader(hf_dir).close()


def check_same_vocabulary(arch: ModelArch, hf_dir: str | os.PathLike, checkpoint) -> None:
    """Raise :class:`ConversionError` unless the HF config is a Stable LatentMoE config of the
    checkpoint's ``vocab_size``: logits over two vocabularies cannot be compared (any other
    difference between the two models shows in the logits)."""
    from .arch import arch_from_config_file

    config = os.path.join(hf_dir, "config.json")
    hf_vocab = arch_from_config_file(config).vocab_size
    if hf_vocab != arch.vocab_size:
        raise not_allowed(
            f"{config}: vocab_size",
            hf_vocab,
            f"{arch.vocab_size}, the vocab_size of the checkpoint {str(checkpoint)!r} (the HF "
            "directory is not its export: logits over two vocabularies cannot be compared)",
            ConversionError,
        )


def verify_export(
    checkpoint: str | os.PathLike,
    hf_dir: str | os.PathLike,
    *,
    config_file: str | None = None,
    atol: float = DEFAULT_ATOL,
    new_tokens: int = DEFAULT_VERIFY_TOKENS,
    batch: int = DEFAULT_VERIFY_BATCH,
    seq_len: int = DEFAULT_VERIFY_SEQ_LEN,
    text: str | None = None,
) -> VerifyReport:
    """Compare the Megatron checkpoint with its HF export (see module docstring)."""
    check_verify_options(atol=atol, new_tokens=new_tokens, batch=batch, seq_len=seq_len, text=text)
    check_hf_dir(hf_dir)
    t0 = time.perf_counter()
    reader, arch, _, _ = open_checkpoint(checkpoint, config_file)
    check_verify_length(arch, seq_len, new_tokens)
    check_same_vocabulary(arch, hf_dir, reader.path)
    check_hf_files(hf_dir)
    # before the models are loaded: a refused --verify-text was refused after both; one
    # tokenizer load (the text was tokenised again after a check of its own)
    tokens, source = sample_tokens(hf_dir, arch.vocab_size, batch, seq_len, text)
    torch.manual_seed(0)
    qat = hf_expert_weight_qat(hf_dir)
    mg = load_megatron_model(reader.path, arch, qat)
    hf = load_hf_model(hf_dir)
    precision = match_stored_precision(mg, hf, arch, reader, hf_dir, mxfp4_experts=qat == "mxfp4")
    lm = megatron_logits(mg, tokens)
    with torch.no_grad():
        lh = hf(tokens).logits.float()
    max_d, mean_d, cos = compare_logits(lm, lh)
    gm, mm = megatron_greedy(mg, tokens, new_tokens)
    gh, mh = hf_greedy(hf, tokens, new_tokens)
    same = torch.equal(gm, gh)
    report = VerifyReport(
        max_d,
        mean_d,
        cos,
        source,
        tuple(tokens.shape),
        new_tokens,
        same,
        megatron_tokens=gm.tolist(),
        hf_tokens=gh.tolist(),
        atol=atol,
        min_margin=min(mm) if mm else float("nan"),
        precision=precision,
    )
    if not same:
        step = int((gm != gh).any(0).nonzero()[0])
        report.first_mismatch = step
        report.megatron_margin_at_mismatch = mm[step]
        report.hf_margin_at_mismatch = mh[step] if step < len(mh) else float("nan")
    report.seconds = time.perf_counter() - t0
    return report
