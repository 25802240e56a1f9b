"""The error the data modules raise for bad input (a JSONL line, a tokenizer, a ``.bin``/``.idx``
pair): its message says what is wrong and where."""


class PreprocessError(Exception):
    """Bad input or tokenizer: the message says what and where (file:line)."""
