"""Fuzzed model files: every damaged GGUF, Hugging Face directory or .tmac file either loads into a model that
runs, or raises ``ModelFormatError`` naming the file — in bounded time and memory, never a crash.

Each target runs in its own process (``tests/fuzz_targets.py``) with its private memory capped, so a crash
shows as a signal and an unchecked allocation as a MemoryError. CI runs ``TMAC_FUZZ_EXAMPLES`` (default 40)
derandomized cases per target; ``make fuzz`` runs 2,600 fresh ones per target (≥ 10,000 in all).
"""
import json
import os
import subprocess
import sys

import pytest

from fuzz_targets import TARGETS

EXAMPLES = int(os.environ.get("TMAC_FUZZ_EXAMPLES", "40"))
CAMPAIGN = "TMAC_FUZZ_EXAMPLES" in os.environ
RESULTS: dict[str, dict] = {}


@pytest.mark.parametrize("target", TARGETS)
def test_fuzzed_model_files(tmp_path, target):
    script = os.path.join(os.path.dirname(__file__), "fuzz_targets.py")
    cmd = [sys.executable, script, target, str(EXAMPLES), str(tmp_path)] + (["--random"] if CAMPAIGN else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60 + 30 * EXAMPLES)
    assert proc.returncode >= 0, f"killed by signal {-proc.returncode}:\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, proc.stderr[:200] + "\n...\n" + proc.stderr[proc.stderr.find("Traceback"):][:6000]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    RESULTS[target] = counts
    assert counts["accepted"] + counts["rejected"] >= EXAMPLES, counts
    assert counts["rejected"] > 0, counts  # the mutations do break files
