"""The one exception type of the converter."""

from __future__ import annotations


class ConversionError(ValueError):
    """Bad input to a conversion: unreadable checkpoint, config not matching the weights, an
    existing output directory, ... The message names the file / tensor / key / field at fault.
    The command-line tool prints it (no traceback) and exits with status 2."""
