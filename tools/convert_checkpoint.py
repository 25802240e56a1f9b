#!/usr/bin/env python
"""Convert Stable LatentMoE checkpoints between Megatron torch_dist and Hugging Face.

    tools/convert_checkpoint.py export --checkpoint SAVE_DIR --output HF_DIR [--dtype bf16]
        [--verify]
    tools/convert_checkpoint.py import --hf HF_DIR --output SAVE_DIR
    tools/convert_checkpoint.py verify --checkpoint SAVE_DIR --hf HF_DIR

Same as ``python -m megatron_latentmoe.convert``; see megatron_latentmoe/convert/cli.py.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_latentmoe.convert.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
