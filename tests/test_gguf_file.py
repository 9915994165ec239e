"""Our GGUF reader against the gguf package's, and against malformed files."""
import hashlib
import struct
import sys

import gguf
import numpy as np
import pytest

from conftest import smaps_kib, smollm2_path
from tmac import ModelFormatError
from tmac.models.files.gguf_file import GGML_TYPES, GGUFFile, ggml_type_row

pytestmark = pytest.mark.unit  # needs no compiler (make unit)


@pytest.mark.slow
def test_reads_smollm2_like_the_gguf_package():
    ours, ref = GGUFFile(smollm2_path()), gguf.GGUFReader(smollm2_path())
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        want = field.contents()
        got = ours.metadata[key]
        assert got == pytest.approx(want) if isinstance(want, float) else got == want, key
    assert len(ours.tensors) == len(ref.tensors)
    for t in ref.tensors:
        mine = ours.tensors[t.name]
        assert mine.type_name == t.tensor_type.name
        assert mine.shape == tuple(int(d) for d in reversed(t.shape))
        assert np.array_equal(mine.data, np.asarray(t.data).view(np.uint8).reshape(-1)), t.name


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_the_type_table_is_the_gguf_packages():
    """Every row of tmac's own ggml type table as the gguf package has it, and every id the package knows found
    (through the table or the package); an id no one knows is None."""
    known = {int(t): (t.name, *gguf.constants.GGML_QUANT_SIZES[t]) for t in gguf.GGMLQuantizationType}
    assert GGML_TYPES.items() <= known.items() and len(GGML_TYPES) >= 22
    assert all(ggml_type_row(i) == row for i, row in known.items())
    assert ggml_type_row(max(known) + 1000) is None


def test_release_unmaps_a_read_tensor_and_keeps_it_readable():
    """A loader releases each tensor once converted, so the file does not stay resident beside the model."""
    f = GGUFFile(smollm2_path())
    t = f.tensors["token_embd.weight"]  # Q8_0, 30 MiB
    digest = hashlib.sha256(t.data).hexdigest()  # reads every page
    address = t.data.ctypes.data
    before = smaps_kib(address, "Rss")
    assert before * 1024 >= t.data.nbytes
    f.release(t)
    after = smaps_kib(address, "Rss")
    assert before - after >= t.data.nbytes // 1024 - 8  # all but the two pages it shares with its neighbours
    assert hashlib.sha256(t.data).hexdigest() == digest  # faulted back in from the page cache


def _header(version=3, tensors=0, kvs=0):
    return b"GGUF" + struct.pack("<IQQ", version, tensors, kvs)


def _string(s: bytes):
    return struct.pack("<Q", len(s)) + s


@pytest.mark.parametrize("blob, field", [
    (b"GGU", "header"),
    (b"GGML" + bytes(20), "magic"),
    (_header(version=7), "version"),
    (_header(kvs=1 << 60), "kv_count"),
    (_header(tensors=1 << 40), "tensor_count"),
    (_header(kvs=1) + _string(b"k") + struct.pack("<I", 8) + struct.pack("<Q", 1 << 50), "k"),
    (_header(kvs=1) + _string(b"arr") + struct.pack("<IIQ", 9, 6, 1 << 40), "arr length"),
    (_header(kvs=1) + _string(b"x") + struct.pack("<I", 99) + bytes(16), "x"),
    (_header(kvs=1) + _string(b"\xff\xfe") + struct.pack("<I", 4) + bytes(4), "metadata key"),
    (_header(tensors=1) + _string(b"w") + struct.pack("<I", 9) + bytes(64), "tensor w"),
    (_header(tensors=1) + _string(b"w") + struct.pack("<IQQIQ", 2, 32, 1 << 39, 0, 0) + bytes(32), "tensor w"),
    (_header(tensors=1) + _string(b"w") + struct.pack("<IQIQ", 1, 64, 12345, 0) + bytes(32), "tensor w"),
    (_header(tensors=1) + _string(b"w") + struct.pack("<IQIQ", 1, 30, 2, 0) + bytes(64), "tensor w"),
])
def test_malformed_files_raise_model_format_error(tmp_path, blob, field):
    path = tmp_path / "bad.gguf"
    path.write_bytes(blob)
    with pytest.raises(ModelFormatError, match=field) as e:
        GGUFFile(str(path))
    assert "bad.gguf" in str(e.value)


def test_truncated_smollm2_fails_cleanly(tmp_path):
    data = open(smollm2_path(), "rb").read()
    for cut in (30, 5000, 2_000_000, len(data) - 10):
        path = tmp_path / "cut.gguf"
        path.write_bytes(data[:cut])
        with pytest.raises(ModelFormatError, match="cut.gguf"):
            GGUFFile(str(path))
