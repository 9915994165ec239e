"""llama.cpp (llama-cpp-python) in a process of its own, the end-to-end benchmark's peer.

Run as a script, never imported by tmac: ``python peer_llama_cpp.py GGUF THREADS N_CTX N_BATCH``. It loads the
model once, then answers each JSON request line on stdin, ``{"prompt": [ids], "gen_tokens": n}``, with one line
``{"prefill": tok/s, "decode": tok/s}`` (a short warm-up, the whole prompt, then greedy decoding one token at a
time, as tmac does). Its own process runs llama.cpp's OpenMP threads with the user's settings: in tmac's process
they would share torch's OpenMP runtime, which ``import tmac`` sets to wait passively — a sleep and wake-up at
every one of llama.cpp's barriers, which made llama.cpp several times slower there.
"""

import json
import os
import sys
import time


def main() -> None:
    path, threads, n_ctx, n_batch = sys.argv[1], *map(int, sys.argv[2:5])
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever the native library prints goes to stderr, never into the answers

    import numpy as np
    from llama_cpp import Llama, llama_get_logits_ith

    llm = Llama(path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=n_batch, verbose=False)
    for line in sys.stdin:
        request = json.loads(line)
        prompt, gen_tokens = request["prompt"], request["gen_tokens"]
        llm.reset()
        llm.eval(prompt[:8])  # warm-up: thread pool
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(gen_tokens):
            token = int(np.ctypeslib.as_array(llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),)).argmax())
            llm.eval([token])
        decode = time.perf_counter() - t0
        answers.write(json.dumps({"prefill": len(prompt) / prefill, "decode": gen_tokens / decode}) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()
