"""Write a seeded random GGUF of a real model's shape, for end-to-end benchmarks that tmac and llama.cpp run on the
very same file. Example:

    .venv/bin/python bench/make_synthetic_gguf.py llama-1b --type Q4_0 -o /tmp/llama-1b-q4_0.gguf
    .venv/bin/tmac bench /tmp/llama-1b-q4_0.gguf --bits 2

``--family`` writes another architecture's tensors at the same shape (qwen2's biases, gemma3's norms and sliding
window, phi3's fused projections …), so each family's decode speed compares with llama's on the same bytes.

``--tokenizer-from FILE`` copies a real model's tokenizer (vocabulary, merges, chat template) from a GGUF whose
vocabulary has the shape's size — ``default`` is the default model's, SmolLM2's 49152 tokens, as ``llama-1b`` has —
so that prompts are as many tokens as a real model makes of them (``bench/serve_load.py``); without it, a
byte-level tokenizer with three merges makes each character nearly a token.

``--type`` is one GGML type for every matrix, or ``Q4_K_M``: llama.cpp's usual mixture of Q4_K and Q6_K.

Shapes: ``llama-1b`` (hidden 2048, ffn 8192, 16 layers, 32/8 heads, vocab 49152) and ``bitnet-3b-llama``
(BitNet b1.58 3B's projection shapes with ffn and hidden rounded up to llama.cpp's 256-blocks, 3328/8704,
26 layers, as a llama-architecture file — for ternary TQ1_0/TQ2_0 weights).
"""
import argparse
import sys
import time

from tmac.models.family.arch import ARCHITECTURES
from tmac.models.family.llama import LlamaConfig
from tmac.models.files.load import default_model_path
from tmac.models.files.synthetic import write_random_gguf
from tmac.base.progress import Progress

SHAPES = {
    "llama-1b": LlamaConfig(vocab_size=49152, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
                            context_length=2048),
    "bitnet-3b-llama": LlamaConfig(vocab_size=32000, dim=3328, n_layers=26, n_heads=26, n_kv_heads=26, ffn_dim=8704,
                                   context_length=2048),
    "bitnet-3b": LlamaConfig(vocab_size=32002, dim=3200, n_layers=26, n_heads=32, n_kv_heads=32, ffn_dim=8640,
                             context_length=2048),  # BitNet b1.58 3B's real shape: an HF directory, not a GGUF
    "tiny": LlamaConfig(vocab_size=512, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=512, context_length=256),
}


def q4_k_m(n_layers: int):
    """llama.cpp's Q4_K_M mixture (its ``llama_tensor_get_type``): Q6_K for the head, and for attn_v and ffn_down in
    the first and last eighths of the layers and every third layer between; Q4_K elsewhere."""
    def more_bits(i: int) -> bool:
        return i < n_layers // 8 or i >= 7 * n_layers // 8 or (i - n_layers // 8) % 3 == 2

    def type_of(name: str) -> str:
        parts = name.split(".")
        if name == "output.weight" or parts[0] == "blk" and parts[2] in ("attn_v", "ffn_down") and \
                more_bits(int(parts[1])):
            return "Q6_K"
        return "Q4_K"
    return type_of


MIXTURES = {"Q4_K_M": q4_k_m}


def weight_types(cfg: LlamaConfig, weight_type: str, embd_type: str | None = None):
    """The GGML type of each tensor name: ``weight_type`` (a type or a ``MIXTURES`` name), the token embedding
    ``embd_type`` if given."""
    type_of = MIXTURES[weight_type](cfg.n_layers) if weight_type in MIXTURES else lambda name: weight_type
    return lambda name: embd_type if embd_type and name.startswith("token_embd") else type_of(name)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("--type", default="Q4_0", help="GGML type of the projections and head (Q4_0, Q4_1, Q4_K, Q8_0, TQ2_0, "
                                                  "TQ1_0, F16, ...) or Q4_K_M; the embedding follows it unless "
                                                  "--embd-type")
    p.add_argument("--embd-type", help="GGML type of the token embedding (default: as --type)")
    p.add_argument("--family", default="llama", choices=sorted(ARCHITECTURES),
                   help="architecture record whose tensors the file holds (default llama)")
    p.add_argument("--tokenizer-from", metavar="FILE",
                   help="a GGUF whose tokenizer the file takes ('default': the default model's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-o", "--output", required=True)
    args = p.parse_args()
    cfg = SHAPES[args.shape]
    tokenizer = default_model_path() if args.tokenizer_from == "default" else args.tokenizer_from
    arch = ARCHITECTURES[args.family]
    per_layer = len(arch.layer_tensors()) - (3 if arch.fused else 0)
    total = 2 + (not cfg.tie_embeddings) + cfg.n_layers * per_layer
    t0 = time.perf_counter()
    with Progress(f"writing {args.output}", total, True) as bar:
        write_random_gguf(args.output, cfg, weight_types(cfg, args.type, args.embd_type), args.seed, bar.advance,
                          args.family, tokenizer)
    print(f"wrote {args.output} ({args.family} {args.shape}, {args.type}) in {time.perf_counter() - t0:.0f} s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
