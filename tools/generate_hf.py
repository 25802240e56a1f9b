"""Generate text from an exported HF directory (``AutoModelForCausalLM``, ``trust_remote_code``).

python tools/generate_hf.py outputs/main_job/hf --prompt "In the beginning" --max-new-tokens 32
"""

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_dir", type=Path, help="an exported HF directory")
    p.add_argument(
        "--prompt", default="In the beginning", help="text to continue (default: %(default)r)"
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=32,
        help="tokens to generate, an integer >= 1 (default: %(default)s)",
    )
    p.add_argument(
        "--sample", action="store_true", help="sample (temperature 0.8) instead of greedy"
    )
    a = p.parse_args(argv)
    if not (a.model_dir / "config.json").is_file():
        return _error(
            f"model_dir={str(a.model_dir)!r} has no config.json (an HF export is expected)"
        )
    if not any(
        (a.model_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")
    ):
        return _error(
            f"model_dir={str(a.model_dir)!r} has no tokenizer files (exported with --tokenizer "
            "none?); export again with a tokenizer, or copy its files there"
        )
    if a.max_new_tokens < 1:
        return _error(f"--max-new-tokens={a.max_new_tokens} is not allowed: an integer >= 1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_latentmoe.convert.errors import ConversionError
    from megatron_latentmoe.convert.verify import check_hf_files

    try:  # from_pretrained raised an OSError / SafetensorError traceback on these (measured)
        check_hf_files(a.model_dir)
    except ConversionError as e:
        return _error(f"model_dir={str(a.model_dir)!r}: {e}")

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(a.model_dir, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(a.model_dir, trust_remote_code=True).eval()
    ids = tokenizer(a.prompt, return_tensors="pt").input_ids
    if ids.shape[1] == 0:
        return _error(f"--prompt={a.prompt!r} is not allowed: a text of at least one token")
    out = model.generate(
        ids,
        max_new_tokens=a.max_new_tokens,
        do_sample=a.sample,
        temperature=0.8 if a.sample else None,
        top_k=None,
        top_p=None,
        pad_token_id=tokenizer.pad_token_id,
    )
    print(tokenizer.decode(out[0], skip_special_tokens=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
