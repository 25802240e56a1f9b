#!/usr/bin/env python
"""Parameter ledger of a Stable LatentMoE model (SPEC §5).

    python tools/ledger.py                          # the full-scale K3 preset
    python tools/ledger.py --hf-config path/config.json
    python tools/ledger.py --latent-size 1792 --num-experts 1792 --topk 32   # overrides (alpha = 4)
    python tools/ledger.py --json                   # machine-readable

Attention is model-specific and is not counted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_latentmoe.fields import ConfigError  # noqa: E402
from megatron_latentmoe.ledger import (  # noqa: E402
    K3_FULL_SCALE,
    LatentMoEShape,
    format_ledger,
    parameter_ledger,
)

PRESETS = {"k3": K3_FULL_SCALE}

# field -> help
INT_FIELDS = {
    "hidden_size": "d",
    "latent_size": "l (latent width of the routed experts)",
    "moe_ffn_hidden_size": "m_e (routed expert intermediate)",
    "num_experts": "n",
    "topk": "k",
    "shared_ffn_hidden_size": "N_s * m_e (0 = no shared experts)",
    "num_layers": "all transformer layers",
    "first_k_dense_replace": "number of leading dense layers",
    "dense_ffn_hidden_size": "intermediate of the dense layers' gated MLP",
    "vocab_size": "V (0 = no embedding / LM head)",
}
BOOL_FIELDS = {
    "latent_norm": "RMSNorm(l) before W_up",
    "tie_word_embeddings": "LM head shares the input embedding",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Attention parameters are model-specific and not counted.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--preset", choices=sorted(PRESETS), default=None, help="start from a preset (default: k3)"
    )
    src.add_argument(
        "--hf-config", metavar="PATH", help="start from an HF config.json (SPEC §6 keys)"
    )
    for field, help_ in INT_FIELDS.items():
        p.add_argument(
            "--" + field.replace("_", "-"),
            dest=field,
            type=int,
            default=None,
            metavar="N",
            help=help_,
        )
    for field, help_ in BOOL_FIELDS.items():
        p.add_argument(
            "--" + field.replace("_", "-"),
            dest=field,
            default=None,
            action=argparse.BooleanOptionalAction,
            help=help_,
        )
    p.add_argument("--json", action="store_true", help="print the ledger as JSON")
    return p


def main(argv=None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    if a.hf_config:
        try:
            with open(a.hf_config) as f:
                cfg = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            parser.error(f"--hf-config {a.hf_config}: {e}")
        except UnicodeDecodeError as e:  # a binary file (a safetensors shard): was a traceback
            parser.error(f"--hf-config {a.hf_config}: not a JSON text file ({e})")
        try:
            shape = LatentMoEShape.from_hf_config(cfg)
        except ValueError as e:
            parser.error(f"--hf-config {a.hf_config}: {e}")
    else:
        shape = PRESETS[a.preset or "k3"]
    overrides = {f: getattr(a, f) for f in (*INT_FIELDS, *BOOL_FIELDS) if getattr(a, f) is not None}
    try:
        shape = dataclasses.replace(shape, **overrides)
    except ConfigError as e:  # a refused value that came from its option names the option
        refused = e.field if e.field in overrides else None
        parser.error(
            e.render(
                lambda name, v: (
                    f"--{name.replace('_', '-')}={v}" if name == refused else f"{name}={v!r}"
                )
            )
        )
    ledger = parameter_ledger(shape)
    text = json.dumps(ledger, indent=2) if a.json else format_ledger(ledger)
    try:
        print(text, flush=True)
    except BrokenPipeError:  # e.g. piped into `head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
