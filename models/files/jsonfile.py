"""Reading the JSON files of model directories, with errors that name the file."""

from __future__ import annotations

import os

from tmac.base import files
from tmac.base.errors import ModelFormatError

MAX_JSON_BYTES = 64 << 20  # configs and tokenizer configs are small; a huge one is hostile


def read_json(path: str, missing_ok: bool = False) -> dict:
    if missing_ok and not os.path.exists(path):
        return {}
    try:
        data = files.read_json(path, MAX_JSON_BYTES)
    except (OSError, ValueError) as e:
        raise ModelFormatError(f"{path}: cannot read JSON ({e})") from None
    if not isinstance(data, dict):
        raise ModelFormatError(f"{path}: expected a JSON object")
    return data
