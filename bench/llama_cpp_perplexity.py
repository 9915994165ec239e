"""llama.cpp's perplexity of a GGUF over a text, windowed as ``llama-perplexity`` (and ``tmac perplexity``) are.

Run in a process of its own: ``python llama_cpp_perplexity.py GGUF TEXT CONTEXT [THREADS]`` prints one JSON line
``{"perplexity": …, "tokens_scored": …, "windows": …, "ids": [the text's token ids]}``.
"""

import json
import math
import os
import sys


def main() -> None:
    path, text_path, context = sys.argv[1], sys.argv[2], int(sys.argv[3])
    threads = int(sys.argv[4]) if len(sys.argv) > 4 else os.cpu_count()
    answer = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what the native library prints goes to stderr

    import numpy as np
    from llama_cpp import Llama

    llm = Llama(path, n_ctx=context, n_batch=context, n_ubatch=context, logits_all=True, n_threads=threads,
                n_threads_batch=threads, verbose=False)
    ids = llm.tokenize(open(text_path, "rb").read(), add_bos=True, special=False)
    bos, add_bos = llm.token_bos(), llm.metadata.get("tokenizer.ggml.add_bos_token", "false") == "true"
    first, nll, count = context // 2, 0.0, 0
    windows = len(ids) // context
    for w in range(windows):
        window = ids[w * context:(w + 1) * context]
        llm.reset()
        llm.eval([bos] + window[1:] if add_bos else window)
        logits = np.asarray(llm.scores[first:context - 1], dtype=np.float64)
        logits -= logits.max(axis=1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        nll -= float(logp[np.arange(len(logp)), window[first + 1:context]].sum())
        count += len(logp)
    answer.write(json.dumps({"perplexity": math.exp(nll / count), "tokens_scored": count, "windows": windows,
                             "ids": ids}) + "\n")


if __name__ == "__main__":
    main()
