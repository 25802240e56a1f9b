"""The model and the training code do not depend on the converter."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_model_and_training_import_no_converter_module():
    code = (
        "import sys\n"
        "from megatron_latentmoe.compat.python311 import apply_python311_compat\n"
        "apply_python311_compat()\n"
        "import megatron_latentmoe.model, megatron_latentmoe.moe.layer, megatron_latentmoe.specs\n"
        "import megatron_latentmoe.training.model_provider\n"
        "bad = [m for m in sys.modules if m.startswith('megatron_latentmoe.convert')]\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
