"""tmac.base.memory: packed weights in one huge-page arena — same results, aligned, really huge — and the KV cache in
ordinary pages, untouched until written."""
import gc
import sys
import threading

import numpy as np
import pytest
import torch
from torch import nn

import tmac
import tmac.base.memory as memory
from conftest import smaps_kib, smollm2_path
from tmac.nn.linear import Linear, gather_packed


def test_huge_page_empty_is_aligned_and_advised(monkeypatch):
    calls = []
    monkeypatch.setattr(memory, "_advise", lambda address, length: calls.append((address, length)) or True)
    t = memory.huge_page_empty(3 * memory.HUGE_PAGE + 5)
    assert t.dtype == torch.uint8 and t.numel() == 3 * memory.HUGE_PAGE + 5
    assert t.data_ptr() % memory.HUGE_PAGE == 0
    storage = t.untyped_storage()
    assert calls == [(t.data_ptr(), 4 * memory.HUGE_PAGE)]  # whole pages, all inside the allocation
    assert t.data_ptr() + 4 * memory.HUGE_PAGE <= storage.data_ptr() + storage.nbytes()
    with pytest.raises(ValueError, match="nbytes"):
        memory.huge_page_empty(-1)
    z = memory.huge_page_full((3, 5, 7), 0, torch.float16)
    assert z.shape == (3, 5, 7) and z.dtype == torch.float16 and not z.any()
    assert torch.equal(memory.huge_page_full((4, 3), 1.5, torch.float32), torch.full((4, 3), 1.5))
    assert torch.signbit(memory.huge_page_full((4, 3), -0.0, torch.float32)).all()  # (a zero's bits are not all 0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fresh anonymous mappings read as zeros on Linux")
@pytest.mark.parametrize("make", [lambda shape, dtype: memory.huge_page_full(shape, 0, dtype), memory.fresh_zeros],
                         ids=["huge pages", "the KV cache's pages"])
def test_a_zero_filled_cache_takes_no_memory_until_written(make):
    """A KV cache starts as zeros without touching its pages: a long context costs memory as it fills, not at once;
    the KV cache's ordinary pages take a first write's few pages, not 2 MiB ones."""
    z = make((64, 1 << 20), torch.float16)  # 128 MiB
    assert z.shape == (64, 1 << 20) and z.dtype == torch.float16
    assert smaps_kib(z.data_ptr(), "Rss") == 0
    z[5, :1000] = 1
    assert 0 < smaps_kib(z.data_ptr(), "Rss") <= 8 << 10
    assert int(z.count_nonzero()) == 1000  # (zeros everywhere else)
    if make is memory.fresh_zeros:  # a first write takes its own page, not 2 MiB
        y = make((64, 1 << 20), torch.float16)
        y[5, :1000] = 1
        assert smaps_kib(y.data_ptr(), "Rss") <= 8 and smaps_kib(y.data_ptr(), "AnonHugePages") == 0
        assert memory.fresh_zeros((3, 0), torch.float32).shape == (3, 0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are a Linux feature")
def test_huge_pages_are_huge_where_the_kernel_offers_them():
    mode = memory.huge_page_mode()
    t = memory.huge_page_empty(8 << 20)
    t.fill_(1)  # first touch: the kernel picks the page size now
    huge = smaps_kib(t.data_ptr(), "AnonHugePages")
    if mode in ("always", "madvise"):
        assert huge >= 2048, f"THP mode {mode}, yet no huge page backs an advised 8 MiB range ({huge} KiB)"
    else:
        assert huge == 0 and mode in ("never", "absent")


def test_gather_packed_keeps_results_and_places_tensors_in_order():
    torch.manual_seed(0)
    model = nn.Sequential(Linear.from_float(nn.Linear(256, 192), bits=2, group_size=64),
                          Linear.from_float(nn.Linear(192, 64, bias=False), bits=4, group_size=64))
    model.append(model[1])  # the same layer twice: its tensors are placed once
    x = torch.randn(3, 256)
    y = model[1](model[0](x))
    before = [t.clone() for t in model.buffers()]
    gather_packed(model)
    assert torch.equal(model[1](model[0](x)), y)
    tensors = [model[0].qweight, model[0].scales, model[0].zeros, model[0].bias,
               model[1].qweight, model[1].scales, model[1].zeros]
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), before))
    base = tensors[0].untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == base for t in tensors)  # one arena
    ptrs = [t.data_ptr() for t in tensors]
    assert ptrs == sorted(ptrs) and all(p % memory.ALIGN == 0 for p in ptrs)  # module order, aligned
    assert tensors[0].data_ptr() % memory.HUGE_PAGE == 0
    assert model[2].qweight is model[1].qweight


def test_loaded_models_and_quantize_model_use_the_arena():
    model = tmac.load_model(smollm2_path(), context=64, progress=False)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) >= 4 * model.config.n_layers
    tensors = [t for m in linears for t in (m.qweight, m.scales) if t is not None]
    # packed where they stay (a PackingArena), never copied into one afterwards
    assert all(memory._in_packing_arena(t) and t.data_ptr() % memory.ALIGN == 0 for t in tensors)
    for layer in model.layers:  # a layer is built by one thread: its tensors lie together, in the order it reads them
        mine = [p for m in layer.modules() if isinstance(m, Linear) for p in (m.qweight, m.scales)]
        if len({t.untyped_storage().data_ptr() for t in mine}) == 1:
            assert [t.data_ptr() for t in mine] == sorted(t.data_ptr() for t in mine)
    # the KV cache: ordinary pages, none of them touched before a token is written
    assert all(smaps_kib(c.data_ptr(), "Rss") == 0 for c in (model.cache_k, model.cache_v))
    small = tmac.quantize_model(nn.Sequential(nn.Linear(256, 128), nn.Linear(128, 64)), bits=3, skip=None,
                                progress=False)
    assert small[0].qweight.untyped_storage().data_ptr() == small[1].qweight.untyped_storage().data_ptr()


def test_a_packing_arena_gives_each_thread_its_own_run_of_aligned_memory():
    arena = memory.PackingArena()
    sizes = [100, 4096, 1, 3 << 20]
    taken = {"a": [], "b": []}
    both = threading.Barrier(2)

    def take(arena, views):
        both.wait()  # two threads at once
        views.extend(arena.empty(n) for n in sizes)

    threads = [threading.Thread(target=take, args=(arena, views)) for views in taken.values()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for views in taken.values():
        starts = [t.data_ptr() for t in views]
        assert [t.nbytes for t in views] == sizes and all(p % memory.ALIGN == 0 for p in starts)
        # one after another, each at the first aligned byte after the last
        assert all(b - a == -(-n // memory.ALIGN) * memory.ALIGN for a, b, n in zip(starts, starts[1:], sizes))
        assert all(memory._in_packing_arena(t) for t in views)
    a, b = taken["a"], taken["b"]
    chunk_a, chunk_b = a[0].untyped_storage().data_ptr(), b[0].untyped_storage().data_ptr()
    assert chunk_a != chunk_b
    for t, value in zip(a + b, range(8)):  # disjoint: each keeps what was written to it
        t.fill_(value)
    assert [int(t[-1]) for t in a + b] == list(range(8))
    big = arena.empty(memory.PackingArena.CHUNK + 1)  # larger than a chunk: a chunk of its own
    assert big.nbytes == memory.PackingArena.CHUNK + 1 and memory._in_packing_arena(big)
    chunks = len(memory._ARENAS)
    del a, b, taken, big, arena
    gc.collect()
    assert len(memory._ARENAS) < chunks  # a chunk's range is forgotten with its last view


def test_packed_empty_makes_arrays_in_the_arena_of_a_loading_model():
    with memory.packing_into_arena():
        w = memory.packed_empty((3, 5))
        s = memory.packed_empty((2, 7), np.float16)
    assert w.dtype == np.uint8 and s.dtype == np.float16 and s.shape == (2, 7)
    assert all(memory._in_packing_arena(torch.from_numpy(x)) for x in (w, s))
    outside = memory.packed_empty((3, 5))
    assert not memory._in_packing_arena(torch.from_numpy(outside))
    # loads at once share one arena, whichever ends first; the last one out lets it go
    first, second = memory.packing_into_arena(), memory.packing_into_arena()
    first.__enter__()
    second.__enter__()
    shared = memory._PACKING
    first.__exit__(None, None, None)
    assert memory._PACKING is shared and memory._in_packing_arena(torch.from_numpy(memory.packed_empty((8,))))
    second.__exit__(None, None, None)
    assert memory._PACKING is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is read from /proc (Linux)")
def test_peak_rss_is_a_process_own_not_inherited_from_its_parent():
    """The benchmark measures each candidate's memory in a process it starts; ru_maxrss would report this (larger)
    process's peak there, VmHWM the child's own."""
    import os
    import resource
    import subprocess

    held = torch.ones(1 << 27)  # 512 MiB resident here
    code = "import resource; from tmac.base.memory import peak_rss_mib; " \
           "print(peak_rss_mib(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    own, inherited = map(float, r.stdout.split())
    assert own < 200 < 512 < memory.peak_rss_mib() and inherited > 512  # the child's RSS is a few tens of MiB
    assert abs(memory.peak_rss_mib(os.getpid()) - memory.peak_rss_mib()) < 64
    assert memory.peak_rss_mib(os.getpid()) <= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 + 1
    del held


def _gguf_blocks(type_name: str, rows: int, k: int):
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from tmac.models.files.synthetic import K_QUANT_TYPES, k_quant_blocks

    if type_name in K_QUANT_TYPES:  # (gguf-py has no K-quant quantizer)
        return k_quant_blocks(np.random.default_rng(0), rows, k, type_name)
    w = np.random.default_rng(0).standard_normal((rows, k)).astype(np.float32)
    return quantize(np.sign(w) if type_name.startswith("TQ") else w, GGMLQuantizationType[type_name])


@pytest.mark.parametrize("type_name", ["Q8_0", "TQ2_0"])
@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "held"])
def test_a_large_tensor_converts_without_copies_of_its_codes(monkeypatch, type_name, streamed):
    """A 49152-row head's codes are 100 MB: importing it, packing it for the kernels and keeping a token table
    must each add at most small slices on top of the result — measured by tracemalloc, which sees numpy's
    allocations. A matrix of ``STREAM_CODES`` codes and more keeps them in the file until packed (``RowCodes``);
    a smaller one holds them, and an 8-bit table then shares them."""
    import tracemalloc

    import numpy as np

    import tmac.quant.embedding as embedding
    import tmac.execution.packing as packing
    import tmac.quant.quantize as q
    from tmac.models.files.load import make_linear
    from tmac.base.qweight import RowCodes

    monkeypatch.setattr(q, "QUANTIZE_CHUNK", 1 << 16)  # slices of 16 rows below
    monkeypatch.setattr(packing, "PACK_WEIGHTS", 1 << 16)
    monkeypatch.setattr(embedding, "PACK_SLICE", 1 << 16)
    rows, k = 2048, 4096
    codes = rows * k  # bytes: one per weight
    monkeypatch.setattr(q, "STREAM_CODES", codes if streamed else codes + 1)
    blocks = _gguf_blocks(type_name, rows, k)
    tracemalloc.start()
    try:
        qw = tmac.import_gguf(blocks, type_name, (rows, k))
        assert isinstance(qw.codes, RowCodes) == streamed
        held = 0 if streamed else codes
        assert tracemalloc.get_traced_memory()[1] < held + 0.5 * codes  # scales (1/8 of the codes) and one slice's
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        layer = make_linear([qw], None, None, False, None, None)
        packed = sum(t.nbytes for t in layer.buffers())
        assert tracemalloc.get_traced_memory()[1] - before < packed + 0.5 * codes  # no second copy of the codes
        tracemalloc.reset_peak()
        table = tmac.Embedding(qw)
        assert tracemalloc.get_traced_memory()[1] - tracemalloc.get_traced_memory()[0] < 0.5 * codes
        if type_name == "Q8_0" and not streamed:  # an 8-bit table stores the codes it holds as they are
            assert np.shares_memory(table.codes.numpy(), qw.codes)
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q6_K", "TQ2_0"])
def test_a_streamed_import_packs_what_the_held_one_packs(monkeypatch, type_name):
    """Codes decoded again a slice at a time as the packing reads them (and a fused projection's parts read in
    place) give the very buffers of codes held whole, and the same codes."""
    import numpy as np

    import tmac.quant.quantize as q
    import tmac.base.qweight as qweight
    from tmac.models.files.load import make_linear

    rows, k = 96, 512
    parts = [_gguf_blocks(type_name, rows, k), _gguf_blocks(type_name, rows // 2, k)]

    def build(streamed: bool):
        monkeypatch.setattr(q, "STREAM_CODES", 0 if streamed else 1 << 40)
        monkeypatch.setattr(qweight, "STACK_COPY", 0 if streamed else 1 << 40)
        qws = [tmac.import_gguf(b, type_name, (len(b), k)) for b in parts]
        return qws, make_linear(qws, None, None, False, None, None), tmac.Embedding(qws[0])

    (held, layer, table), (streamed, s_layer, s_table) = build(False), build(True)
    for a, b in zip(held, streamed):
        assert np.array_equal(np.asarray(b.codes), a.codes) and np.array_equal(b.scales, a.scales)
    for module, other in ((layer, s_layer), (table, s_table)):
        for (name, x), (_, y) in zip(module.named_buffers(), other.named_buffers()):
            assert torch.equal(x, y), name


def test_huge_page_copies_lie_in_order_in_one_arena_and_equal_the_originals():
    a, b = torch.arange(10, dtype=torch.int16).reshape(2, 5), torch.randn(3)
    copies = memory.huge_page_copies((a, None, b), 3)
    assert len(copies) == 3 and all(c[1] is None for c in copies)
    assert all(torch.equal(c[0], a) and torch.equal(c[2], b) for c in copies)
    flat = [t for c in copies for t in (c[0], c[2])]
    ptrs = [t.data_ptr() for t in flat]
    assert ptrs == sorted(ptrs) and len(set(ptrs)) == 6 and all(p % memory.ALIGN == 0 for p in ptrs)
    assert all(t.untyped_storage().data_ptr() == flat[0].untyped_storage().data_ptr() for t in flat)
    copies[0][0].fill_(0)  # copies, not views of the original or of each other
    assert torch.equal(copies[1][0], a) and a.any()
    with pytest.raises(ValueError, match="positive int"):
        memory.huge_page_copies((a,), 0)


@pytest.fixture(scope="module")
def converted_smollm2(tmp_path_factory) -> str:
    import subprocess

    out = tmp_path_factory.mktemp("converted") / "m.tmac"
    r = subprocess.run([sys.executable, "-m", "tmac", "convert", smollm2_path(), "-o", str(out)], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    return str(out)


@pytest.mark.slow
def test_loading_a_converted_file_peaks_no_higher_than_loading_its_gguf(converted_smollm2, tmp_path):
    """A .tmac file is mapped, not copied, and its token table stays in it as the GGUF's does
    (``StreamedEmbedding``): loading it takes no more memory than loading the GGUF. One written with
    ``--shared-table`` unpacks its tied table from the head, a few rows at a time: no more than the GGUF plus the
    table unpacked."""
    import subprocess

    shared = tmp_path / "shared.tmac"
    r = subprocess.run([sys.executable, "-m", "tmac", "convert", smollm2_path(), "-o", str(shared), "--shared-table"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    code = ("import sys, tmac; from tmac.base.memory import peak_rss_mib; m = tmac.load_model(sys.argv[1], progress=False); "
            "print(peak_rss_mib(), m.tok_embeddings.codes.nbytes / 2**20)")
    (gguf, _), (converted, _), (unpacked, table) = [
        map(float, subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True,
                                  check=True).stdout.split())
        for path in (smollm2_path(), converted_smollm2, str(shared))]
    assert converted <= gguf, f"peak RSS loading the GGUF {gguf:.0f} MiB, the .tmac {converted:.0f} MiB"
    assert unpacked <= gguf + table, f"peak RSS loading the GGUF {gguf:.0f} MiB, the shared-table .tmac " \
                                     f"{unpacked:.0f} MiB (its token table {table:.0f} MiB)"


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the kernel's /proc/PID/smaps")
def test_two_processes_running_a_converted_file_share_its_pages(converted_smollm2):
    """The packed weights of a loaded .tmac are the file's pages (a mapping of it, as the kernel lists it), and a
    second process running the same file shares them with the first instead of holding a copy."""
    import json
    import subprocess

    code = """if True:
        import json, os, re, sys, tmac
        from tmac.nn.linear import Linear
        model = tmac.load_model(sys.argv[1], progress=False, context=64)
        tmac.Session(model).generate("Hi", max_new_tokens=2)
        path, maps, at = os.path.realpath(sys.argv[1]), [], None
        with open("/proc/self/smaps") as f:
            for line in f:
                head = re.match(r"([0-9a-f]+)-([0-9a-f]+) \\S+ \\S+ \\S+ \\S+ *(.*)$", line)
                if head:
                    at = dict(start=int(head[1], 16), end=int(head[2], 16), file=head[3])
                    maps.append(at)
                elif ":" in line and line.split()[-1] == "kB":
                    at[line.split(":")[0]] = int(line.split()[1])
        mine = [m for m in maps if m["file"] == path]
        packed = [t for m in model.modules() if isinstance(m, Linear) for t in (m.qweight, m.scales)]
        inside = sum(any(m["start"] <= t.data_ptr() < m["end"] for m in mine) for t in packed)
        print(json.dumps(dict(packed=len(packed), inside=inside, bytes=sum(t.nbytes for t in packed),
                              rss=sum(m["Rss"] for m in mine) * 1024, shared=sum(m["Shared_Clean"] for m in mine) * 1024,
                              private=sum(m["Private_Dirty"] for m in mine) * 1024)), flush=True)
        sys.stdin.read()  # held until the other process has looked
    """
    first = subprocess.Popen([sys.executable, "-c", code, converted_smollm2], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        alone = json.loads(first.stdout.readline())
        second = subprocess.run([sys.executable, "-c", code, converted_smollm2], input="", capture_output=True,
                                text=True, timeout=300)
        assert second.returncode == 0, second.stderr
        both = json.loads(second.stdout)
    finally:
        first.communicate("", timeout=60)
    for seen in (alone, both):
        assert seen["inside"] == seen["packed"] > 100, seen  # every projection's weights and scales: the file's
        assert seen["rss"] >= seen["bytes"] and seen["private"] < 1 << 20, seen  # read, never written
    assert both["shared"] >= 0.95 * both["bytes"], both  # the second process holds no copy of its own


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the kernel's /proc/self/smaps")
def test_pages_of_a_mapped_file_read_once_can_be_dropped_and_read_again(tmp_path):
    """``release_read_pages`` drops a mapped file's pages from this process (its resident memory falls) and the
    bytes read the same afterwards; on memory of the process's own it does nothing."""
    import os

    data = torch.arange(8 << 20, dtype=torch.int64).to(torch.uint8)
    path = tmp_path / "blob"
    path.write_bytes(data.numpy().tobytes())
    with open(path, "rb") as f:
        mapped = memory.mapped_file(f.fileno(), os.path.getsize(path))
    view = mapped[4096:]
    assert torch.equal(view, data[4096:])  # read: resident
    before = smaps_kib(mapped.data_ptr(), "Rss")
    memory.release_read_pages(view)
    after = smaps_kib(mapped.data_ptr(), "Rss")
    assert before >= 8 << 10 and after <= 8, (before, after)  # KiB: all but the first page (outside the view) gone
    assert torch.equal(mapped, data)
    own = data.clone()
    memory.release_read_pages(own)  # not a mapping: left alone
    assert torch.equal(own, data)
