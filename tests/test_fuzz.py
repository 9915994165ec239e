"""Fuzzing: every damaged GGUF, Hugging Face directory or .tmac file either loads into a model that runs, or raises
``ModelFormatError`` naming the file — in bounded time and memory, never a crash; misuse of the kernel paths is a
clear Python exception; and each class of hostile input (a tampered kernel cache, resource bombs, special files,
deep nesting, type lies, layout lies: ``fuzz_hostile.py``; the server and mapped files: ``fuzz_server.py``) ends as
its target says.

Each target runs in its own process (``tests/fuzz_targets.py``) with its private memory capped, so a crash
shows as a signal and an unchecked allocation as a MemoryError. CI runs ``TMAC_FUZZ_EXAMPLES`` (default 40)
derandomized cases per target; ``make fuzz`` runs 1,000 fresh ones per target.
"""
import json
import os
import subprocess
import sys

import pytest

from fuzz_targets import TARGETS

EXAMPLES = int(os.environ.get("TMAC_FUZZ_EXAMPLES", "40"))
CAMPAIGN = "TMAC_FUZZ_EXAMPLES" in os.environ


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
def test_fuzz_target(tmp_path, target, record_property):
    script = os.path.join(os.path.dirname(__file__), "fuzz_targets.py")
    cmd = [sys.executable, script, target, str(EXAMPLES), str(tmp_path)] + (["--random"] if CAMPAIGN else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60 + 30 * EXAMPLES)
    assert proc.returncode >= 0, f"killed by signal {-proc.returncode}:\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, proc.stderr[:200] + "\n...\n" + proc.stderr[proc.stderr.find("Traceback"):][:6000]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    del counts["target"]
    space = counts.pop("_space", EXAMPLES)  # a target with fewer distinct cases runs out of them
    record_property("fuzz", (target, counts))  # for the run's summary (conftest), from any xdist worker
    assert sum(counts.values()) >= min(EXAMPLES, space), counts
    assert set(counts) - {"accepted"}, counts  # the mutations do break things


def _edit_tmac_metadata(seed: bytes, key: str, edit) -> bytes:
    import fuzz_targets as ft

    header, body = ft.safetensors_parts(seed)
    meta = json.loads(header["__metadata__"][key])
    edit(meta)
    header["__metadata__"][key] = json.dumps(meta)
    return ft.safetensors_join(header, body)


def test_cases_the_campaigns_found(tmp_path):
    """Each of these once escaped as TypeError, ZeroDivisionError, a bare Exception or a RuntimeError at the
    first forward; each must now be a ModelFormatError naming the file."""
    import fuzz_targets as ft
    import tmac
    from tmac import ModelFormatError

    ft.write_gguf(str(tmp_path / "seed.gguf"))
    ft.write_tmac(str(tmp_path / "seed.gguf"), str(tmp_path / "seed.tmac"))
    seed = (tmp_path / "seed.tmac").read_bytes()

    def first_spec(extra_states, field, value):
        next(v for v in extra_states["extra_state"].values() if "spec" in v)["spec"][field] = value

    cases = {
        "heads.tmac": _edit_tmac_metadata(seed, "tmac_model", lambda m: m["config"].update(n_heads=1, n_kv_heads=1)),
        "vector.tmac": _edit_tmac_metadata(seed, "tmac", lambda m: first_spec(m, "vector_bytes", 0)),
        "tokenizer.tmac": _edit_tmac_metadata(seed, "tmac_model", lambda m: m["tokenizer"].update(json_z64="")),
    }
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
    ft.write_hf_dir(str(tmp_path / "hf"))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "architectures": 1}))
    for path in [*(tmp_path / n for n in cases), tmp_path / "hf"]:
        with pytest.raises(ModelFormatError, match=path.name):
            tmac.load_model(str(path), context=8, progress=False)
