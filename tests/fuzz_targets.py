"""Fuzzing: the model loaders with damaged files, and the paths into compiled kernels with misuse.

Run as ``python tests/fuzz_targets.py TARGET EXAMPLES DIR [--random]`` (``tests/test_fuzz.py`` does): prepares
its seeds in DIR, caps the process's private memory a little above what it then uses, runs EXAMPLES
hypothesis cases and prints one JSON line of counts ("accepted" / "rejected").

- file targets (``gguf``, ``hf-config``, ``hf-safetensors``, ``tmac``): every mutated file either loads into a
  model that runs, or raises ``ModelFormatError`` naming the file, within ``SECONDS_PER_CASE``;
- misuse targets (``linear-misuse``, ``kernel-misuse``): random dtypes, shapes, layouts, misaligned and
  non-tensor arguments given to ``tmac.Linear``, to the checked ``lut_linear`` and to the raw compiled
  functions either give the right result or raise a Python exception (TypeError/ValueError before any kernel
  runs, for the checked paths).

A crash shows as a signal in the parent, an unchecked allocation as MemoryError, a hang as its timeout.

Each seed is a small valid model of one kind — a GGUF file (Q4_0/Q4_1/F16/F32 tensors, a byte-level BPE
tokenizer), a Hugging Face directory (config.json + safetensors), a ``.tmac`` file — and each mutation
breaks it in one of the ways hostile or damaged files do: truncation, flipped bytes, extreme integers written
over header fields, spans inserted or deleted, absurd values put into the JSON (configs, safetensors headers,
tmac metadata) and shapes that contradict the config.
"""

from __future__ import annotations

import json
import math
import os
import resource
import shutil
import struct
import sys
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz_hostile import HOSTILE_TARGETS
from fuzz_server import SERVER_TARGETS
from fuzz_outputs import OUTPUT_TARGETS

DIM, FFN, HEADS, KV_HEADS, LAYERS = 64, 64, 2, 1, 1
EXTREMES = [0, 1, 2, 3, 31, 32, 255, 256, 2**16, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**62, 2**63 - 1,
            2**64 - 1]
SECONDS_PER_CASE = 30.0
HEADROOM = 1 << 30  # bytes of private memory a case may allocate beyond what loading the seeds took
FLOAT_BITS = [math.nan, math.inf, -math.inf, 0.0, -0.0, 1e38, 1e-45]


def write_gguf(path: str) -> None:
    """A 1-layer llama GGUF whose projections are Q4_0, Q4_1 and F16, with a tokenizer and a chat template."""
    from tmac.models.family.llama import LlamaConfig
    from tmac.models.files.synthetic import write_random_gguf

    types = {"attn_output": "Q4_1", "ffn_down": "F16", "token_embd": "F32"}
    cfg = LlamaConfig(vocab_size=260, dim=DIM, n_layers=LAYERS, n_heads=HEADS, n_kv_heads=KV_HEADS, ffn_dim=FFN,
                      context_length=64, tie_embeddings=True)
    write_random_gguf(path, cfg, lambda name: types.get(name.split(".")[-2], "Q4_0"))


def write_hf_dir(path: str, vocab: int = 96) -> None:
    """A 1-layer float ``LlamaForCausalLM`` directory, written without transformers (config by hand)."""
    import torch
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": DIM, "intermediate_size": FFN,
           "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
           "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": True}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    g = torch.Generator().manual_seed(0)
    hd = DIM // HEADS
    shapes = {"model.embed_tokens.weight": (vocab, DIM), "model.norm.weight": (DIM,)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (DIM,), p + "post_attention_layernorm.weight": (DIM,),
                   p + "self_attn.q_proj.weight": (HEADS * hd, DIM), p + "self_attn.k_proj.weight": (KV_HEADS * hd, DIM),
                   p + "self_attn.v_proj.weight": (KV_HEADS * hd, DIM), p + "self_attn.o_proj.weight": (DIM, HEADS * hd),
                   p + "mlp.gate_proj.weight": (FFN, DIM), p + "mlp.up_proj.weight": (FFN, DIM),
                   p + "mlp.down_proj.weight": (DIM, FFN)}
    save_file({k: torch.randn(s, generator=g) for k, s in shapes.items()}, os.path.join(path, "model.safetensors"))


def write_tmac(gguf_path: str, path: str) -> None:
    """The GGUF seed converted to a ``.tmac`` file (what ``tmac convert`` writes)."""
    import tmac
    from tmac.models.files.tmac_file import save_model

    save_model(tmac.load_model(gguf_path, context=8, progress=False), path)


# ---- mutations --------------------------------------------------------------------------------------------------

def _overwrite(data: bytes, pos: int, value: int, width: int) -> bytes:
    pos = min(pos, max(0, len(data) - width))
    return data[:pos] + (value % (1 << (8 * width))).to_bytes(width, "little") + data[pos + width:]


@st.composite
def byte_mutation(draw, data: bytes, hot: int) -> bytes:
    """One damaging edit of ``data``; positions favour the first ``hot`` bytes (headers and metadata)."""
    n = len(data)
    pos = draw(st.one_of(st.integers(0, max(0, min(hot, n) - 1)), st.integers(0, n - 1)))
    kind = draw(st.sampled_from(["truncate", "flip", "int", "float", "insert", "delete"]))
    if kind == "truncate":
        return data[:pos]
    if kind == "flip":
        out = bytearray(data)
        for p in draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=8)) + [pos]:
            out[p] = draw(st.integers(0, 255))
        return bytes(out)
    if kind == "int":
        return _overwrite(data, pos, draw(st.sampled_from(EXTREMES)), draw(st.sampled_from([1, 2, 4, 8])))
    if kind == "float":
        return _overwrite(data, pos, struct.unpack("<I", struct.pack("<f", draw(st.sampled_from(FLOAT_BITS))))[0], 4)
    span = draw(st.integers(1, 64))
    if kind == "insert":
        return data[:pos] + draw(st.binary(min_size=span, max_size=span)) + data[pos:]
    return data[:pos] + data[pos + span:]


JSON_VALUES = st.one_of(st.sampled_from(EXTREMES + [-1, -(2**63), 0.5, math.nan, math.inf]), st.none(), st.booleans(),
                        st.text(max_size=20), st.just("x" * 100_000), st.lists(st.integers(-5, 300), max_size=4),
                        st.just({}), st.just({"rope_type": "llama3"}))


@st.composite
def json_mutation(draw, obj):
    """``obj`` (parsed JSON) with one leaf replaced by an absurd value, deleted, or a key added."""
    paths = []

    def walk(node, path):
        if isinstance(node, dict):
            for key, value in node.items():
                paths.append(path + (key,))
                walk(value, path + (key,))
        elif isinstance(node, list) and len(node) <= 16:  # long lists (token lists) are byte-fuzzed instead
            for i, value in enumerate(node):
                paths.append(path + (i,))
                walk(value, path + (i,))

    walk(obj, ())
    obj = json.loads(json.dumps(obj))
    if not paths:
        return draw(JSON_VALUES)
    path = draw(st.sampled_from(paths))
    parent = obj
    for key in path[:-1]:
        parent = parent[key]
    action = draw(st.sampled_from(["set", "set", "set", "delete", "add"]))
    if action == "delete" and isinstance(parent, dict):
        del parent[path[-1]]
    elif action == "add" and isinstance(parent, dict):
        parent[draw(st.text(max_size=12))] = draw(JSON_VALUES)
    else:
        parent[path[-1]] = draw(JSON_VALUES)
    return obj


def safetensors_parts(data: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def safetensors_join(header: dict, body: bytes) -> bytes:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + body


@st.composite
def safetensors_mutation(draw, data: bytes) -> bytes:
    """A structured edit of a safetensors file's header: a tensor entry, or the JSON inside ``__metadata__``."""
    header, body = safetensors_parts(data)
    meta = header.get("__metadata__", {})
    nested = [k for k, v in meta.items() if v.startswith("{")]
    if nested and draw(st.booleans()):
        key = draw(st.sampled_from(nested))
        header["__metadata__"][key] = json.dumps(draw(json_mutation(json.loads(meta[key]))))
    else:
        header = draw(json_mutation(header))
    return safetensors_join(header, body) if isinstance(header, dict) else json.dumps(header).encode()


# ---- the campaign -----------------------------------------------------------------------------------------------

def load_case(path: str) -> str:
    """Load ``path``: 'accepted' (and the model runs) or 'rejected' with a ModelFormatError naming the file."""
    import tmac
    from tmac import ModelFormatError

    t0 = time.perf_counter()
    try:
        model = tmac.load_model(path, context=8, progress=False)
    except ModelFormatError as e:
        if os.path.basename(path) not in str(e):
            raise AssertionError(f"the error does not name the file: {e}") from e
        outcome = "rejected"
    else:
        logits = tmac.Session(model).logits([0, 1, 2])
        assert logits.shape == (3, model.config.vocab_size), logits.shape
        outcome = "accepted"
    elapsed = time.perf_counter() - t0
    assert elapsed < SECONDS_PER_CASE, f"{path} took {elapsed:.1f} s"
    return outcome


def _write(path: str, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
    return path


def write_seeds(d: str) -> None:
    write_gguf(os.path.join(d, "seed.gguf"))
    write_hf_dir(os.path.join(d, "hf"))
    write_tmac(os.path.join(d, "seed.gguf"), os.path.join(d, "seed.tmac"))
    for name in ("seed.gguf", "hf", "seed.tmac"):  # every seed is valid and runs (this also compiles its kernels)
        assert load_case(os.path.join(d, name)) == "accepted", name


def file_cases(target: str, d: str):
    """(hypothesis strategy of a mutation, function writing one mutated case and returning the path to load)."""
    from tmac.models.files.gguf_file import GGUFFile

    if target == "gguf":
        seed = open(os.path.join(d, "seed.gguf"), "rb").read()
        hot = GGUFFile(os.path.join(d, "seed.gguf"))._pos  # end of the tensor infos: past it are just weights
        return byte_mutation(seed, hot), lambda data: _write(os.path.join(d, "case.gguf"), data)
    if target == "tmac":
        seed = open(os.path.join(d, "seed.tmac"), "rb").read()
        hot = 8 + int.from_bytes(seed[:8], "little")
        return (st.one_of(safetensors_mutation(seed), byte_mutation(seed, hot)),
                lambda data: _write(os.path.join(d, "case.tmac"), data))
    case_dir = os.path.join(d, f"case-{target}")
    shutil.copytree(os.path.join(d, "hf"), case_dir)
    if target == "hf-config":
        config = json.load(open(os.path.join(d, "hf", "config.json")))
        return json_mutation(config), lambda obj: (_write(os.path.join(case_dir, "config.json"),
                                                          json.dumps(obj).encode()), case_dir)[1]
    if target == "hf-safetensors":
        seed = open(os.path.join(d, "hf", "model.safetensors"), "rb").read()
        return (st.one_of(safetensors_mutation(seed), byte_mutation(seed, 1024)),
                lambda data: (_write(os.path.join(case_dir, "model.safetensors"), data), case_dir)[1])
    raise ValueError(f"unknown fuzz target {target!r}; known: {TARGETS}")


# ---- misuse of the kernel paths ---------------------------------------------------------------------------------

DTYPES = ["float32", "float16", "bfloat16", "float64", "int32", "int64", "int8", "uint8", "bool", "complex64"]


@st.composite
def tensor_like(draw, shape: tuple[int, ...], dtype: str):
    """Mostly the right tensor, else one wrong in dtype, a dimension, layout, alignment or type."""
    import torch

    dims = list(shape)
    if dims and draw(st.integers(0, 3)) == 0:  # a wrong dimension
        i = draw(st.integers(0, len(dims) - 1))
        dims[i] = draw(st.sampled_from([0, 1, dims[i] - 1, dims[i] + 1, dims[i] * 2]))
    if draw(st.integers(0, 9)) == 0:  # a wrong rank
        dims = dims[:-1] if dims and draw(st.booleans()) else dims + [1]
    dims = [max(0, d) for d in dims]
    dt = dtype if draw(st.integers(0, 3)) else draw(st.sampled_from(DTYPES))
    t = (torch.randn(dims) * 4).to(getattr(torch, dt))
    layout = draw(st.sampled_from(["plain"] * 4 + ["transposed", "strided", "misaligned", "numpy", "list", "none"]))
    if layout == "transposed" and t.dim() >= 2:
        t = t.transpose(-1, -2).contiguous().transpose(-1, -2)
    elif layout == "strided" and t.dim() >= 1:
        t = torch.repeat_interleave(t, 2, dim=-1)[..., ::2]
    elif layout == "misaligned":
        flat = torch.empty(t.numel() + 1, dtype=t.dtype)
        t = flat[1:].view(t.shape).copy_(t)
    elif layout == "numpy" and dt not in ("bfloat16",):
        return t.numpy()
    elif layout == "list":
        return t.tolist()
    elif layout == "none":
        return None
    return t


def _linear_layers():
    import torch

    import tmac

    torch.manual_seed(0)
    return [tmac.Linear.from_float(torch.randn(40, 64), bits=b, group_size=g, bias=torch.randn(40) if b % 2 else None)
            for b, g in ((1, 32), (2, 64), (3, 32), (4, "row"))]


def linear_misuse_cases():
    import torch
    import torch.nn.functional as F

    layers = _linear_layers()

    @st.composite
    def strategy(draw):
        lin = draw(st.sampled_from(layers))
        lead = draw(st.lists(st.integers(0, 3), max_size=3))
        x = draw(tensor_like(tuple(lead) + (64,), "float32"))
        grad = isinstance(x, torch.Tensor) and x.is_floating_point() and draw(st.booleans())
        return lin, x, grad, draw(st.booleans())

    def check(case) -> str:
        lin, x, requires_grad, grad_mode = case
        if requires_grad:
            x.requires_grad_(True)
        try:
            with torch.set_grad_enabled(grad_mode):
                y = lin(x)
        except (TypeError, ValueError) as e:
            assert str(e), "an exception without a message"
            return "rejected"
        except RuntimeError as e:
            assert requires_grad and grad_mode and "inference-only" in str(e), e
            return "rejected"
        assert isinstance(x, torch.Tensor) and x.shape[-1] == 64 and x.dtype in (torch.float32, torch.float16,
                                                                                  torch.bfloat16), (x, y)
        assert y.shape == x.shape[:-1] + (40,) and y.dtype == x.dtype, (y.shape, y.dtype)
        ref = F.linear(x.detach().float(), lin.dequantized_weight(), lin.bias)
        if ref.numel():
            err = float((y.float() - ref).norm() / ref.norm().clamp(min=1e-6))
            assert err < (0.02 if x.dtype == torch.float32 else 0.05), err
        return "accepted"
    return strategy(), check


def kernel_misuse_cases():

    from tmac.execution.lut_ops import lut_linear
    from tmac.quant.spec import packed_shapes

    lin = _linear_layers()[2]  # 3 bits, zeros, bias
    spec, m, k = lin.spec, lin.out_features, lin.in_features
    lib = __import__("tmac.execution.lut_ops", fromlist=["kernels_for"]).kernels_for(spec)
    w_shape, s_shape = packed_shapes(spec, m)
    rows = spec.n_tile

    @st.composite
    def strategy(draw):
        n = draw(st.integers(0, 6))
        which = draw(st.sampled_from(["lut_linear", "build_tables", "lut_gemv", "lut_gemm"]))
        tables = [draw(tensor_like((rows, k // 4, 16), "int8")), draw(tensor_like((rows, k // spec.lut_group), "float32")),
                  draw(tensor_like((rows, k // spec.group_size), "float32"))]
        packed = [draw(tensor_like(w_shape, "uint8")), draw(tensor_like(s_shape, "float32")),
                  draw(tensor_like(s_shape, "float32"))]
        if which == "lut_linear":
            args = (draw(tensor_like((n, k), "float32")), *packed, draw(tensor_like((m,), "float32")), spec,
                    draw(st.sampled_from([m, m - 1, m + 1, 0, -3, 10**9])))
        elif which == "build_tables":
            args = (draw(tensor_like((n, k), "float32")), *tables)
        elif which == "lut_gemv":
            args = (draw(tensor_like((n, k), "float32")), *packed, *tables, draw(tensor_like((n, m), "float32")))
        else:
            args = (*packed, *tables, draw(tensor_like((n, m), "float32")))
        if draw(st.integers(0, 9)) == 0:  # a wrong argument count
            args = args[:-1] if draw(st.booleans()) else args + (args[-1],)
        return which, args

    def check(case) -> str:
        which, args = case
        try:
            if which == "lut_linear":
                lut_linear(*args)
            else:
                getattr(lib, which)(*args)
        except (TypeError, ValueError) as e:
            assert str(e)
            return "rejected"
        except RuntimeError as e:  # only the raw compiled functions: TVM's own argument checks
            assert which != "lut_linear", e
            return "rejected"
        return "accepted"
    return strategy(), check


FILE_TARGETS = ("gguf", "hf-config", "hf-safetensors", "tmac")
TARGETS = FILE_TARGETS + ("linear-misuse", "kernel-misuse") + tuple(HOSTILE_TARGETS) + tuple(OUTPUT_TARGETS) + \
    tuple(SERVER_TARGETS)


def campaign(target: str, examples: int, d: str, randomize: bool) -> dict[str, int]:
    if target == "linear-misuse":
        strategy, check = linear_misuse_cases()
    elif target == "kernel-misuse":
        strategy, check = kernel_misuse_cases()
    elif target in HOSTILE_TARGETS or target in OUTPUT_TARGETS or target in SERVER_TARGETS:
        strategy, check = {**HOSTILE_TARGETS, **OUTPUT_TARGETS, **SERVER_TARGETS}[target](d)
    else:
        write_seeds(d)
        strategy, write = file_cases(target, d)

        def check(mutated):
            return load_case(write(mutated))
    with open("/proc/self/status") as f:
        used = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:"))
    resource.setrlimit(resource.RLIMIT_DATA, (used + HEADROOM, resource.getrlimit(resource.RLIMIT_DATA)[1]))
    counts: dict[str, int] = {}
    trace = bool(os.environ.get("TMAC_FUZZ_TRACE"))

    if getattr(check, "share", None):  # a slow target runs a share of the cases
        examples = max(1, examples // check.share)
        check.space = examples

    @settings(max_examples=examples, deadline=None, derandomize=not randomize, database=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def run(case):
        if trace:  # a case that kills the process is the last one printed
            print(f"case: {case!r:.2000}", file=sys.stderr, flush=True)
        outcome = check(case)
        counts[outcome] = counts.get(outcome, 0) + 1

    run()
    if getattr(check, "space", None):
        counts["_space"] = check.space
    return counts


if __name__ == "__main__":
    target, examples, directory = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    print(json.dumps({"target": target, **campaign(target, examples, directory, "--random" in sys.argv)}))
