"""kvferry: long-context decoding with the KV cache in host memory, ferried to the GPU layer by layer."""

__version__ = "0.1.0"


class KvferryError(Exception):
    """An error caused by user input or the environment; the CLI prints it as one line."""
