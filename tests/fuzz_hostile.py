"""Fuzz targets for hostile inputs, one per class of attack (``tests/fuzz_targets.py`` runs them):

- ``cache``: a kernel cache entry damaged or tampered with (bytes, ELF headers re-signed in the sidecar, a planted
  library in a directory others can write, special files, nesting, a bad ``tuning.json``): the kernel computes
  exactly what the pristine one did — from the cache, rebuilt, or from a private directory — never a signal;
- ``bombs``: tokenizer configs and chat templates built to exhaust memory or time: loaded, rendered and run
  within the case's time and memory, or ``ModelFormatError`` naming the file;
- ``special``: a FIFO, device, directory, socket, sparse terabyte file or link loop in place of any model file or
  kernel-directory file: refused naming it, or read when it is a link to a real file;
- ``nesting``: JSON nested up to a million deep in any JSON the runtime reads: malformed, not ``RecursionError``;
- ``types``: GGUF metadata values and tensor types replaced by other GGUF types: ``ModelFormatError`` naming the
  file and the field, or a model that runs;
- ``layout``: ``.tmac`` kernel specs and packed tensors changed without repacking: refused, or (when the change
  does not alter the layout) logits equal to the untouched file's.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import warnings

import numpy as np
from hypothesis import strategies as st

SIZES = [0, 1, 2, 10, 1000, 10**5, 10**6, 10**9, 2**31, 2**63]
DEPTHS = [2, 50, 500, 990, 1000, 5000, 100_000, 1_000_000]


def _expect_named(fn, name: str, errors=None) -> str:
    """'accepted' if ``fn`` returns, 'rejected' if it raises one of ``errors`` naming ``name``."""
    from tmac import KernelUnavailableError, ModelFormatError

    try:
        fn()
    except (errors or (ModelFormatError, KernelUnavailableError)) as e:  # noqa: B030 (a tuple, chosen at run time)
        assert name in str(e), f"the error does not name {name}: {type(e).__name__}: {e}"
        return "rejected"
    return "accepted"


def _run_model(path: str, **kw) -> None:
    import tmac

    model = tmac.load_model(path, progress=False, **kw)
    logits = tmac.Session(model).logits([0, 1, 2])
    assert logits.shape == (3, model.config.vocab_size), logits.shape
    tmac.Session(model).generate([0, 1, 2],
            max_new_tokens=2, ignore_eos=True, temperature=0)  # the decode plan: its glue kernels too


def _forget_loaded_kernels() -> None:
    """This process's loaded libraries and warnings forgotten: the next load reads the (damaged) files again."""
    from tmac.quant import cache
    from tmac.execution import lut_ops, runtime

    runtime._loaded.clear()
    cache.warned_dirs.clear()
    lut_ops._libraries.clear()


def _write_model_seeds(d: str) -> None:
    """In ``d``: seed.gguf, seed.tmac, hf/ (with a tokenizer), sharded/ (the same in two shards) and kernels/ (what
    ``tmac compile`` writes for seed.gguf)."""
    from fuzz_targets import write_gguf, write_tmac

    write_gguf(os.path.join(d, "seed.gguf"))
    write_tmac(os.path.join(d, "seed.gguf"), os.path.join(d, "seed.tmac"))
    write_hf_chat_dir(os.path.join(d, "hf"))
    _shard(os.path.join(d, "hf"), os.path.join(d, "sharded"))
    _compile_dir(os.path.join(d, "seed.gguf"), os.path.join(d, "kernels"))


def _nest(depth: int, style: str) -> str:
    if style == "list":
        return "[" * depth + "]" * depth
    if style == "dict":
        return '{"a":' * depth + "0" + "}" * depth
    if style == "mixed":
        return '[{"a":' * (depth // 2) + "0" + "}]" * (depth // 2)
    return "[" * depth  # unterminated


# ---- cache ------------------------------------------------------------------------------------------------------

CACHE_DAMAGE = ["truncate", "flip", "int", "directory", "fifo", "/dev/zero", "/dev/urandom", "dangling link",
                "link loop", "nested", "json", "delete", "world-writable", "group-writable file", "other owner",
                "planted, dir writable by others", "planted, dir of another user"]


def cache_cases(d: str):
    """Two kernels compiled into a pristine cache; each case copies it, damages one file of the 2-bit kernel's entry
    (or ``tuning.json``), and computes with that kernel through the runtime."""
    import torch

    from tmac import quantize_weight
    from tmac.quant import cache, choose
    from tmac.execution import lut_ops

    pristine = os.path.join(d, "pristine")
    os.environ["TMAC_CACHE_DIR"] = pristine
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 256)).astype(np.float32)
    weights = {b: lut_ops.LutWeight.from_quantized(quantize_weight(w, bits=b, group_size=64)) for b in (2, 4)}
    x = torch.from_numpy(rng.standard_normal((1, 256)).astype(np.float32))
    expected = weights[2].matmul(x)
    weights[4].matmul(x)  # compiles the kernel planted in the cases
    spec, other = weights[2].spec, weights[4].spec
    entry_dir = os.path.relpath(cache.cache_dir(), pristine)
    counter = [0]

    @st.composite
    def strategy(draw):
        damage = draw(st.sampled_from(CACHE_DAMAGE))
        target = draw(st.sampled_from([".so", ".json", ".lock", "tuning.json"]))
        return (damage, target, draw(st.booleans()), draw(st.integers(0, 2**32)), draw(st.sampled_from(DEPTHS)),
                draw(st.sampled_from(SIZES)))

    def check(case) -> str:
        damage, target, resign, seed, depth, value = case
        counter[0] += 1
        root = os.path.join(d, f"case{counter[0]}")
        shutil.copytree(pristine, root, symlinks=True)
        entry = os.path.join(root, entry_dir)
        path = os.path.join(entry, "tuning.json" if target == "tuning.json" else spec.name + target)
        so, sidecar = os.path.join(entry, spec.name + ".so"), os.path.join(entry, spec.name + ".json")
        if target == "tuning.json":  # a tuning table that names this kernel's parameters, then damaged
            key = choose.key(spec.isa, spec.bits, spec.k, spec.group_size, spec.lut_group, spec.has_zeros)
            with open(path, "w") as f:
                json.dump({key: {"block_rows": value, "unroll": 3, "n_tile": 2, "k_chunk": 5}}, f)
        # re-signed edits of a library stay in its ELF and program headers, which tmac.base.elf vets in full: past them
        # lie the dynamic tables, symbols and code — the library's content, which a sidecar re-signed by the cache's
        # owner vouches for, as for any library the user builds. Unsigned edits go anywhere (the sha256 catches them)
        hot = _elf_header_ranges(path) if resign and target == ".so" else [(0, 1 << 30)]
        _damage_file(path, damage, np.random.default_rng(seed), depth, value, hot)
        if damage.startswith("planted"):  # the other kernel's library in this one's place, its sidecar matching
            shutil.copyfile(os.path.join(entry, other.name + ".so"), so)
            resign = True
            if damage.endswith("writable by others"):
                os.chmod(entry, 0o777)
            else:
                os.chown(entry, 12345, 12345)
        if resign and os.path.isfile(so) and os.path.isfile(sidecar) and not os.path.islink(sidecar):
            _resign(so, sidecar)
        _forget_loaded_kernels()
        choose._table.cache_clear()
        os.environ["TMAC_CACHE_DIR"] = root
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            weight = lut_ops.LutWeight.from_quantized(quantize_weight(w, bits=2, group_size=64))
            y = weight.matmul(x)
        assert torch.equal(y, expected), f"{damage} of {target}: the kernel computes something else"
        said = " ".join(str(c.message) for c in caught)
        if "moved to" in said:
            return "rebuilt"
        if "for this process only" in said:
            return "private cache"
        if "tuning.json" in said:
            return "tuning ignored"
        return "used"
    check.share = 4  # a case that rebuilds compiles a kernel (about a second): a quarter of the campaign's cases
    return strategy(), check


def _position(rng, ranges: list[tuple[int, int]], size: int) -> int:
    start, end = ranges[int(rng.integers(0, len(ranges)))]
    return int(rng.integers(min(start, size - 1), max(min(end, size), min(start, size - 1) + 1)))


def _damage_file(path: str, damage: str, rng, depth: int, value: int, hot: list[tuple[int, int]]) -> None:
    """Damage ``path``; byte edits fall in the byte ranges ``hot``."""
    exists = os.path.lexists(path)
    data = open(path, "rb").read() if exists and os.path.isfile(path) else b""
    if damage in ("truncate", "flip", "int", "json", "nested") and not data:
        damage = "delete"
    if damage == "truncate":
        data = data[:int(rng.integers(0, len(data)))]
    elif damage == "flip":
        out = bytearray(data)
        for _ in range(int(rng.integers(1, 8))):
            out[_position(rng, hot, len(out))] = int(rng.integers(0, 256))
        data = bytes(out)
    elif damage == "int":
        pos, width = _position(rng, hot, len(data)), int(rng.choice([1, 2, 4, 8]))
        pos = min(pos, max(0, len(data) - width))
        data = data[:pos] + (value % (1 << (8 * width))).to_bytes(width, "little") + data[pos + width:]
    elif damage == "nested":
        data = _nest(depth, str(rng.choice(["list", "dict", "mixed", "open"]))).encode()
    elif damage == "json":
        try:
            obj = json.loads(data)
        except ValueError:
            obj = {}
        if isinstance(obj, dict) and obj:
            obj[str(rng.choice(sorted(obj)))] = [None, value, "x", [], {}, -1][int(rng.integers(0, 6))]
        data = json.dumps(obj).encode()
    if damage in ("truncate", "flip", "int", "nested", "json"):
        with open(path, "wb") as f:
            f.write(data)
        return
    if damage in ("world-writable", "group-writable file", "other owner"):
        if exists:
            if damage == "other owner":
                os.lchown(path, 12345, 12345)
            else:
                os.chmod(path, 0o666 if damage == "world-writable" else 0o664)
        return
    if damage.startswith("planted"):
        return
    if exists:
        shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.unlink(path)
    _special(path, damage)


def _elf_header_ranges(path: str) -> list[tuple[int, int]]:
    """The ELF header and program header table of ``path`` (as byte ranges)."""
    data = open(path, "rb").read(64)
    (phoff,), (_, phnum) = struct.unpack_from("<Q", data, 32), struct.unpack_from("<HH", data, 54)
    return [(0, 64), (phoff, phoff + 56 * phnum)]


def _special(path: str, kind: str) -> None:
    """Put a special file of ``kind`` at ``path`` (nothing, for 'delete')."""
    if kind == "directory":
        os.mkdir(path)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind.startswith("/dev/") or kind.startswith("/proc/"):
        os.symlink(kind, path)
    elif kind == "dangling link":
        os.symlink(path + ".nowhere", path)
    elif kind == "link loop":
        os.symlink(path, path)
    elif kind == "socket":
        s, cwd = socket.socket(socket.AF_UNIX), os.getcwd()
        os.chdir(os.path.dirname(path))  # (a socket's path is at most 107 bytes)
        try:
            s.bind(os.path.basename(path))
        finally:
            os.chdir(cwd)
            s.close()
    elif kind == "sparse terabyte":
        with open(path, "wb") as f:
            f.truncate(1 << 40)
    elif kind == "empty":
        open(path, "wb").close()


def _resign(so: str, sidecar: str) -> None:
    """Update the sidecar to the library's present bytes, as someone tampering with the cache would."""
    from tmac.quant import cache

    try:
        meta = json.load(open(sidecar))
    except (ValueError, RecursionError):
        return
    if isinstance(meta, dict):
        meta.update(sha256=cache.sha256(so), bytes=os.path.getsize(so))
        with open(sidecar, "w") as f:
            json.dump(meta, f)


# ---- resource bombs ---------------------------------------------------------------------------------------------

TEMPLATE_PIECES = [
    "{% for i in range(N) %}{% for j in range(N) %}x{% endfor %}{% endfor %}",
    "{{ 'x' * N }}", "{{ [0] * N }}", "{{ messages | tojson(indent=N) }}", "{{ 'x' | center(N) }}",
    "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "{{ '%*d' % (N, 1) }}", "{{ range(N) | list | length }}",
    "{{ (messages * N) | length }}", "{{ lipsum(N) }}", "{{ 'x' | indent(N) }}", "{{ N ** N }}", "{{ 10 ** N }}",
    "{% set s = namespace(v='xy') %}{% for i in range(N) %}{% set s.v = s.v ~ s.v %}{% endfor %}{{ s.v | length }}",
    "{{ ('x' * 1000) | wordwrap(1) }}", "{{ 'ab' | replace('', 'x' * 1000) }}", "{{ (N * 'ab') | length }}",
    "{{ 'x' | truncate(N) }}", "{{ messages[0]['content'] * N }}", "{{ (('x' ~ 'y') * N) | upper }}",
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}", "{{ raise_exception('no') }}",
    "{{ 'x' | format(N) }}", "{{ '{:>{}}'.format('x', N) }}", "{{ 'x'.ljust(N) }}", "{{ 'x'.zfill(N) }}",
    "{{ [1, 2] | batch(N) | list }}", "{{ 'x' | list | join('y' * N) }}", "{{ range(N) | sum }}",
]


def write_hf_chat_dir(path: str) -> None:
    """A 1-layer float Llama directory with a byte-level BPE ``tokenizer.json`` and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from fuzz_targets import write_hf_dir

    write_hf_dir(path, vocab=260)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {t: i for i, t in enumerate(sorted(alphabet))}
    vocab["<|endoftext|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|endoftext|>", "chat_template": TEMPLATE_PIECES[20]}, f)


NORMALIZER_STEPS = [{"type": "Replace", "pattern": {"String": ""}, "content": "C"},
                    {"type": "Replace", "pattern": {"String": "a"}, "content": "C"},
                    {"type": "Replace", "pattern": {"Regex": ".*"}, "content": "C"},
                    {"type": "Prepend", "prepend": "C"}, {"type": "NFKC"}, {"type": "Lowercase"},
                    {"type": "Strip", "strip_left": True, "strip_right": True}]


def bombs_cases(d: str):
    import tmac

    seed = os.path.join(d, "chat")
    write_hf_chat_dir(seed)
    tokenizer_json = json.load(open(os.path.join(seed, "tokenizer.json")))
    counter = [0]

    @st.composite
    def strategy(draw):
        n = st.sampled_from(SIZES)
        kind = draw(st.sampled_from(["template", "template", "normalizer", "padding", "truncation", "added token"]))
        if kind == "template":
            pieces = draw(st.lists(st.sampled_from(TEMPLATE_PIECES), min_size=1, max_size=3))
            return kind, "".join(p.replace("N", str(draw(n))) for p in pieces)
        if kind == "normalizer":
            steps = draw(st.lists(st.sampled_from(range(len(NORMALIZER_STEPS))), min_size=1, max_size=5))
            return kind, [dict(NORMALIZER_STEPS[i], **({"content": "x" * draw(st.sampled_from([1, 10, 1000, 10**5]))}
                                                        if "content" in NORMALIZER_STEPS[i] else {})) for i in steps]
        return kind, draw(n)

    def check(case) -> str:
        kind, value = case
        counter[0] += 1
        path = os.path.join(d, f"case{counter[0]}")
        shutil.copytree(seed, path)
        spec = json.loads(json.dumps(tokenizer_json))
        name = "tokenizer.json"
        if kind == "template":
            name = "tokenizer_config.json"
            with open(os.path.join(path, name), "w") as f:
                json.dump({"eos_token": "<|endoftext|>", "chat_template": value}, f)
        elif kind == "normalizer":
            spec["normalizer"] = {"type": "Sequence", "normalizers": value}
        elif kind == "padding":
            spec["padding"] = {"strategy": {"Fixed": value % 2**63}, "direction": "Right", "pad_to_multiple_of": None,
                               "pad_id": 0, "pad_type_id": 0, "pad_token": "<|endoftext|>"}
        elif kind == "truncation":
            spec["truncation"] = {"direction": "Right", "max_length": value % 2**63, "strategy": "LongestFirst",
                                  "stride": 0}
        else:
            spec["added_tokens"].append({"id": 259, "content": "y" * min(value, 10**7), "single_word": False,
                                         "lstrip": False, "rstrip": False, "normalized": True, "special": False})
        with open(os.path.join(path, "tokenizer.json"), "w") as f:
            json.dump(spec, f)

        def chat():
            import tmac

            model = tmac.load_model(path, context=8, progress=False)
            text = model.tokenizer.render_chat([{"role": "user", "content": "hello " * 50}])
            ids = model.tokenizer.encode(text)[:4]
            assert tmac.Session(model).logits(ids or [0]).shape[-1] == 260
        outcome = _expect_named(chat, name, (tmac.ModelFormatError, ValueError))  # ValueError: raise_exception
        shutil.rmtree(path)
        return outcome
    return strategy(), check


# ---- special files ----------------------------------------------------------------------------------------------

SPECIAL_ERRORS = (__import__("tmac").ModelFormatError, __import__("tmac").KernelUnavailableError,
                  FileNotFoundError)  # a link to nowhere in place of the model path: no such file
SPECIAL_KINDS = ["fifo", "/dev/zero", "/dev/urandom", "/dev/null", "directory", "dangling link", "link loop", "socket",
                 "sparse terabyte", "empty", "link to a copy"]


def special_cases(d: str):
    """Each case puts one special file in place of one file of a model (GGUF, .tmac, Hugging Face directory, sharded
    checkpoint) or of a kernel directory, and loads and runs the model."""
    _write_model_seeds(d)
    sharded, kernel_files = os.path.join(d, "sharded"), sorted(os.listdir(os.path.join(d, "kernels")))
    targets = ([("gguf", "seed.gguf"), ("tmac", "seed.tmac")]
               + [("hf", f) for f in sorted(os.listdir(os.path.join(d, "hf")))]
               + [("sharded", f) for f in sorted(os.listdir(sharded))] + [("kernels", f) for f in kernel_files])
    counter = [0]

    def check(case) -> str:
        (where, name), kind = case
        counter[0] += 1
        case_dir = os.path.join(d, f"case{counter[0]}")
        os.makedirs(case_dir)
        for src in ("seed.gguf", "seed.tmac", "hf", "sharded", "kernels"):
            (shutil.copytree if os.path.isdir(os.path.join(d, src)) else shutil.copyfile)(
                os.path.join(d, src), os.path.join(case_dir, src))
        path = os.path.join(case_dir, name) if where in ("gguf", "tmac") else os.path.join(case_dir, where, name)
        os.replace(path, path + ".real")
        if kind == "link to a copy":
            os.symlink(path + ".real", path)
        else:
            _special(path, kind)
        _forget_loaded_kernels()
        source = {"gguf": path, "tmac": path, "hf": os.path.dirname(path), "sharded": os.path.dirname(path),
                  "kernels": os.path.join(case_dir, "seed.gguf")}[where]
        if where == "kernels":
            os.environ["TMAC_KERNEL_DIR"] = os.path.dirname(path)
        try:
            outcome = _expect_named(lambda: _run_model(source, context=8), name, SPECIAL_ERRORS)
        finally:
            os.environ.pop("TMAC_KERNEL_DIR", None)
        if kind == "link to a copy" or (kind == "/dev/null" and name.endswith(".lock")):
            assert outcome == "accepted", (where, name, kind)
        shutil.rmtree(case_dir)
        return f"{outcome} ({kind})" if outcome == "accepted" else outcome
    check.space = len(targets) * len(SPECIAL_KINDS)  # every case there is: a campaign may run out of new ones
    return st.tuples(st.sampled_from(targets), st.sampled_from(SPECIAL_KINDS)), check


def _shard(src: str, dst: str) -> None:
    """``src`` with its safetensors split in two shards and an index, as large Hugging Face checkpoints come."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    os.unlink(os.path.join(dst, "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, os.path.join(dst, shard))
        weight_map |= {k: shard for k in keys}
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def _compile_dir(model: str, out: str) -> None:
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "tmac", "compile", "--model", model, "-o", out], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr


# ---- nesting ----------------------------------------------------------------------------------------------------

def nesting_cases(d: str):
    from fuzz_targets import safetensors_parts

    _write_model_seeds(d)
    documents = ["hf/config.json", "hf/tokenizer.json", "hf/tokenizer_config.json", "sharded/model.safetensors.index.json",
                 "hf/model.safetensors header", "seed.tmac tmac", "seed.tmac tmac_model", "kernels/manifest.json"]
    counter = [0]

    @st.composite
    def strategy(draw):
        return (draw(st.sampled_from(documents)), draw(st.sampled_from(DEPTHS)),
                draw(st.sampled_from(["list", "dict", "mixed", "open"])), draw(st.integers(0, 2**32)))

    def check(case) -> str:
        document, depth, style, seed = case
        counter[0] += 1
        case_dir = os.path.join(d, f"case{counter[0]}")
        file, _, key = document.partition(" ")
        src = file.split("/")[0]
        os.makedirs(case_dir)
        (shutil.copytree if os.path.isdir(os.path.join(d, src)) else shutil.copyfile)(
            os.path.join(d, src), os.path.join(case_dir, src))
        path = os.path.join(case_dir, file)
        nested = _nest(depth, style)
        rng = np.random.default_rng(seed)
        if key:  # a JSON string inside a safetensors header, or the header itself
            header, body = safetensors_parts(open(path, "rb").read())
            if key == "header":
                victim = str(rng.choice(sorted(header)))
                raw = json.dumps({**header, victim: 0}).replace('"%s": 0' % victim, f'"{victim}": {nested}')
            else:
                header["__metadata__"][key] = _nest_into(header["__metadata__"][key], nested, rng)
                raw = json.dumps(header)
            raw = raw.encode() + b" " * (-len(raw) % 8)
            data = struct.pack("<Q", len(raw)) + raw + body
        else:
            data = _nest_into(open(path).read(), nested, rng).encode()
        with open(path, "wb") as f:
            f.write(data)
        _forget_loaded_kernels()
        source = {"hf": os.path.dirname(path), "sharded": os.path.dirname(path), "seed.tmac": path,
                  "kernels": os.path.join(d, "seed.gguf")}[src]
        if src == "kernels":
            os.environ["TMAC_KERNEL_DIR"] = os.path.dirname(path)
        try:
            outcome = _expect_named(lambda: _run_model(source, context=8), os.path.basename(file))
        finally:
            os.environ.pop("TMAC_KERNEL_DIR", None)
        shutil.rmtree(case_dir)
        return outcome
    return strategy(), check


def _nest_into(text: str, nested: str, rng) -> str:
    """``text`` (a JSON document) with the root or one value of its top-level object replaced by ``nested``."""
    obj = json.loads(text)
    if not isinstance(obj, dict) or not obj or rng.integers(0, 4) == 0:
        return nested
    victim = str(rng.choice(sorted(obj)))
    marker = "\u0000nest\u0000"
    obj[victim] = marker
    return json.dumps(obj).replace(json.dumps(marker), nested)


# ---- type lies in GGUF ------------------------------------------------------------------------------------------

GGUF_VALUES = ["uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64", "float32", "float64", "bool",
               "string", "array of int32", "array of strings", "array of float32", "array of arrays"]  # (gguf-py writes no
# empty array: the GGUF byte fuzzing covers those)
TENSOR_TYPES = ["F64", "I8", "I16", "I32", "I64", "BF16", "Q8_K", "IQ2_XXS", "IQ1_S", "Q8_1", "MXFP4"]


def types_cases(d: str):
    import gguf

    from fuzz_targets import write_gguf

    seed = os.path.join(d, "seed.gguf")
    write_gguf(seed)
    reader = gguf.GGUFReader(seed)
    keys = [k for k in reader.fields if not k.startswith("GGUF.") and k != "general.architecture"]
    tensors = [t.name for t in reader.tensors]

    @st.composite
    def strategy(draw):
        if draw(st.integers(0, 3)) == 0:
            return "tensor", draw(st.sampled_from(tensors)), draw(st.sampled_from(TENSOR_TYPES))
        return "key", draw(st.sampled_from(keys)), (draw(st.sampled_from(GGUF_VALUES)), draw(st.sampled_from(SIZES)))

    def check(case) -> str:
        what, name, lie = case
        path = os.path.join(d, "case.gguf")
        _rewrite_gguf(reader, path, name if what == "key" else None, lie if what == "key" else None,
                      name if what == "tensor" else None, lie if what == "tensor" else None)
        return _expect_named(lambda: _run_model(path, context=8), "case.gguf")
    return strategy(), check


def _gguf_value(kind: str, n: int):
    import gguf

    T = gguf.GGUFValueType
    scalar = {"uint8": T.UINT8, "int8": T.INT8, "uint16": T.UINT16, "int16": T.INT16, "uint32": T.UINT32,
              "int32": T.INT32, "uint64": T.UINT64, "int64": T.INT64, "float32": T.FLOAT32, "float64": T.FLOAT64,
              "bool": T.BOOL}
    if kind in scalar:
        bits = {"uint8": 8, "int8": 8, "uint16": 16, "int16": 16, "uint32": 32, "int32": 32}.get(kind, 64)
        if kind.startswith("float"):
            return float(n), scalar[kind]
        if kind == "bool":
            return bool(n % 2), T.BOOL
        v = n % (1 << bits)
        return (v - (1 << bits) if kind.startswith("int") and v >= 1 << (bits - 1) else v), scalar[kind]
    if kind == "string":
        return "x" * min(n, 1000), T.STRING
    if kind == "array of int32":
        return [n % 2**31] * 3, T.ARRAY
    if kind == "array of strings":
        return ["a", "b c", str(n)], T.ARRAY
    if kind == "array of float32":
        return [0.5, float(n)], T.ARRAY
    return [[1, 2], [3]], T.ARRAY


def _rewrite_gguf(reader, path: str, key: str | None, lie, tensor: str | None, tensor_type: str | None) -> None:
    """A copy of ``reader``'s file with one metadata value or one tensor's type replaced."""
    import gguf

    w = gguf.GGUFWriter(path, "llama")
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name == key:
            value, vtype = _gguf_value(*lie)
            if vtype == gguf.GGUFValueType.ARRAY and value and isinstance(value[0], list):
                w.add_key_value(name, value, vtype, sub_type=gguf.GGUFValueType.ARRAY)
            else:
                w.add_key_value(name, value, vtype)
            continue
        vtype = field.types[0]
        value = field.contents()
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(name, value, vtype, sub_type=field.types[-1])
        else:
            w.add_key_value(name, value, vtype)
    for t in reader.tensors:
        if t.name == tensor:
            qtype = gguf.GGMLQuantizationType[tensor_type]
            block, size = gguf.constants.GGML_QUANT_SIZES[qtype]
            shape = [int(x) for x in reversed(t.shape)]  # rows first
            row = shape[-1] // block * size if shape[-1] % block == 0 else shape[-1] * size
            data = np.frombuffer(np.random.default_rng(0).bytes(row * int(np.prod(shape[:-1]))), np.uint8)
            w.add_tensor(t.name, data.reshape(*shape[:-1], row), raw_dtype=qtype)
        else:
            w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ---- layout lies in .tmac ---------------------------------------------------------------------------------------

SPEC_FIELDS = ["k_chunk", "n_tile", "block_rows", "unroll", "lut_group", "group_size", "bits", "quads", "triples",
               "has_zeros", "scale_dtype", "super_groups", "vector_bytes", "isa", "k", "act_group"]


def layout_cases(d: str):
    import torch

    import tmac
    from fuzz_targets import write_gguf, write_tmac

    write_gguf(os.path.join(d, "seed.gguf"))
    seed = os.path.join(d, "seed.tmac")
    write_tmac(os.path.join(d, "seed.gguf"), seed)
    expected = tmac.Session(tmac.load_model(seed, context=8, progress=False)).logits([0, 1, 2])
    from safetensors import safe_open

    with safe_open(seed, framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    layers = [k for k, v in json.loads(meta["tmac"])["extra_state"].items() if isinstance(v, dict) and "spec" in v]
    packed = [k for k in tensors if k.endswith(("qweight", "scales", "zeros"))]

    @st.composite
    def strategy(draw):
        kind = draw(st.sampled_from(["spec", "spec", "spec, no checksum", "bytes", "swap"]))
        return (kind, draw(st.sampled_from(SPEC_FIELDS)), draw(st.sampled_from([None, 0, 1, 2, -1, 0.5, True, "x",
                                                                                "half", "double", "neighbour"])),
                draw(st.booleans()), draw(st.integers(0, 2**32)))

    def check(case) -> str:
        from safetensors.torch import save_file

        kind, field, value, every_layer, rnd = case
        rng = np.random.default_rng(rnd)
        state = json.loads(meta["tmac"])
        out = {k: v.clone() for k, v in tensors.items()}
        if kind.startswith("spec"):
            for layer in layers if every_layer else [layers[int(rng.integers(0, len(layers)))]]:
                extra = state["extra_state"][layer]
                old = extra["spec"].get(field)
                extra["spec"][field] = ({"half": old // 2 if isinstance(old, int) else old, "double": old * 2 if
                                         isinstance(old, int) else old, "neighbour": old + 1 if isinstance(old, int)
                                         else old}.get(value, value) if isinstance(value, str) else value)
                if kind.endswith("no checksum"):
                    extra.pop("checksum", None)
        elif kind == "bytes":
            name = packed[int(rng.integers(0, len(packed)))]
            raw = out[name].view(torch.uint8).flatten()
            raw[int(rng.integers(0, raw.numel()))] ^= int(rng.integers(1, 256))
        else:
            same = {}
            for name in packed:
                same.setdefault((tuple(out[name].shape), out[name].dtype, name.rsplit(".", 1)[-1]), []).append(name)
            pairs = [v for v in same.values() if len(v) > 1]
            if pairs:
                a, b = pairs[int(rng.integers(0, len(pairs)))][:2]
                out[a], out[b] = out[b], out[a]
        path = os.path.join(d, "case.tmac")
        save_file(out, path, metadata={**meta, "tmac": json.dumps(state)})

        def run():
            got = tmac.Session(tmac.load_model(path, context=8, progress=False)).logits([0, 1, 2])
            assert torch.allclose(got, expected, rtol=1e-4, atol=1e-4), \
                f"{kind} {field}={value}: loaded and computed other logits ({(got - expected).abs().max():.3g})"
        return _expect_named(run, "case.tmac")
    return strategy(), check


HOSTILE_TARGETS = {"cache": cache_cases, "bombs": bombs_cases, "special": special_cases, "nesting": nesting_cases,
                   "types": types_cases, "layout": layout_cases}


# ---- hub refs ---------------------------------------------------------------------------------------------------

REF_VALUES = ["/", "/etc", "/tmp", "..", "../../..", "snapshots/../../..", "0" * 40, "0" * 39, "g" * 40, "",
              "\n", "\x00" * 40, "a" * 10 ** 6, "\u2603" * 40, "THE-SNAPSHOT", "THE-SNAPSHOT\n", "/THE-SNAPSHOT-PATH",
              "OTHER-SNAPSHOT"]
REF_FILES = ["fifo", "/dev/zero", "/dev/urandom", "/dev/null", "directory", "dangling link", "link loop"]


def hub_refs_cases(d: str):
    """A cached repo whose ``refs/main`` holds another value (a path, a traversal, another repo's commit, bytes)
    or is a special file: resolving it by name returns a file inside the repo's own snapshot or is refused
    naming the ref; never a path elsewhere, never a hang or an unbounded read."""
    from tmac import ModelFormatError
    from tmac.models.files import hub

    commit, other = "0123456789abcdef0123456789abcdef01234567", "89abcdef0123456789abcdef0123456789abcdef"
    counter = [0]

    def lay_out(root: str, repo: str, sha: str) -> str:
        base = os.path.join(root, "models--" + repo.replace("/", "--"))
        snap = os.path.join(base, "snapshots", sha)
        os.makedirs(snap)
        os.makedirs(os.path.join(base, "refs"), exist_ok=True)
        with open(os.path.join(snap, "m.gguf"), "wb") as f:
            f.write(b"GGUF")
        with open(os.path.join(base, "refs", "main"), "w") as f:
            f.write(sha)
        return base

    def check(case) -> str:
        value, special = case
        counter[0] += 1
        root = os.path.join(d, f"hub{counter[0]}")
        base = lay_out(root, "acme/repo", commit)
        lay_out(root, "acme/other", other)
        ref = os.path.join(base, "refs", "main")
        os.unlink(ref)
        if special is not None:
            _special(ref, special)
        else:
            text = value.replace("THE-SNAPSHOT-PATH", os.path.join(base, "snapshots", commit)) \
                .replace("THE-SNAPSHOT", commit).replace("OTHER-SNAPSHOT", other)
            with open(ref, "w", encoding="utf-8", errors="surrogatepass") as f:
                f.write(text)
        os.environ.update(HF_HUB_CACHE=root, HF_HUB_OFFLINE="1")
        try:
            path = hub.resolve("acme/repo")
        except (ModelFormatError, FileNotFoundError, ValueError) as e:
            assert "refs" in str(e) or "not in the Hugging Face cache" in str(e), f"{type(e).__name__}: {e}"
            outcome = "rejected"
        else:
            assert os.path.realpath(path).startswith(os.path.realpath(base) + os.sep), (case, path)
            outcome = "accepted"
        finally:
            for k in ("HF_HUB_CACHE", "HF_HUB_OFFLINE"):
                os.environ.pop(k, None)
        shutil.rmtree(root)
        if value == "THE-SNAPSHOT" and special is None:
            assert outcome == "accepted", case
        return outcome
    cases = [(v, None) for v in REF_VALUES] + [(None, s) for s in REF_FILES]
    check.space = len(cases)
    return st.sampled_from(cases), check


# ---- API keys ---------------------------------------------------------------------------------------------------

KEY_VALUES = ["", " ", "\t", "k", "sesame", "sesame ", " sesame", "ses ame", "a\nb", "\x00", "ключ", "k" * 10 ** 4,
              "Bearer", "bearer x"]
SENT = ["", "Bearer", "Bearer ", "Bearer  ", "bearer KEY", "Bearer KEY", "BEARER KEY", "Bearer KEY ", "Basic KEY",
        "Bearer KEYx", "Bearer xKEY", "KEY", "Bearer  KEY", "Bearer \x00"]


def api_keys_cases(d: str):
    """A server key and an ``Authorization`` header: a key no client could send (empty, blank, spaces at its ends,
    control or non-ASCII characters) is refused at start-up; for the others a request gets through exactly when
    it carries ``Bearer KEY`` (any case of the scheme), else 401."""
    import asyncio

    from tmac.apps.serve import _RequireKey
    from tmac.apps.serve_http import check_api_key

    def check(case) -> str:
        key, sent = case
        try:
            check_api_key(key)
        except ValueError as e:
            assert "API key" in str(e)
            assert not key.strip() or key != key.strip() or not key.isprintable() or not key.isascii(), key
            return "refused at start-up"
        header = sent.replace("KEY", key)
        passed = []

        async def app(scope, receive, send):
            passed.append(True)

        async def send(message):
            if message["type"] == "http.response.start":
                passed.append(message["status"])

        async def receive():
            return {"type": "http.request", "body": b""}

        scope = {"type": "http", "path": "/v1/models", "method": "GET",
                 "headers": [(b"authorization", header.encode("latin-1", "replace"))] if sent else []}
        asyncio.run(_RequireKey(app, key)(scope, receive, send))
        scheme, _, token = header.partition(" ")
        want = scheme.lower() == "bearer" and token.strip() == key
        assert (passed == [True]) == want, (key, header, passed)
        return "let through" if want else "401"
    cases = [(k, s) for k in KEY_VALUES for s in SENT]
    check.space = len(cases)
    return st.sampled_from(cases), check


HOSTILE_TARGETS.update({"hub-refs": hub_refs_cases, "api-keys": api_keys_cases})
