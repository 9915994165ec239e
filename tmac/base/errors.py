"""Exceptions tmac raises on purpose."""


class ModelFormatError(ValueError):
    """A model or kernel file is malformed; the message names the file and the field."""


class KernelUnavailableError(RuntimeError):
    """No compiled kernel can serve this request on this machine (the message says why)."""


class InexactImport(ValueError):
    """A tensor of an exactly importable GGUF type holds a block whose parameters the format cannot store
    exactly (a zero that is not a float32 value); loaders take it another way."""
