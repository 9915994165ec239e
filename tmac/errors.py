"""Exceptions tmac raises on purpose."""


class ModelFormatError(ValueError):
    """A model or kernel file is malformed; the message names the file and the field."""


class KernelUnavailableError(RuntimeError):
    """No compiled kernel can serve this request on this machine (the message says why)."""
