"""``python -m megatron_latentmoe.convert {export,import,verify} ...`` (see ``cli.py``)."""

import sys

from .cli import main

sys.exit(main())
