"""Run inside the aarch64 Python under qemu (bench/arm64_counts.py starts it): load MODEL, generate GEN tokens
after a PROMPT-token prompt (greedy, past the end-of-text token, one thread), then write this process's memory map
to MAPS — the counting plugin's addresses are attributed by it.

    guest_tmac.py MODEL PROMPT GEN MAPS
"""

import sys
import warnings

import tmac

TEXT = ("The lighthouse keeper climbed the winding stairs each evening, lit the great lamp, and watched the ships "
        "pass far out on the dark water, counting them in a notebook that had belonged to his father. ") * 8


def main() -> None:
    model_path, prompt, gen, maps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    tmac.set_num_threads(1)
    warnings.filterwarnings("error", message=".*packed for")  # a repack would count a load's work, not a run's
    model = tmac.load_model(model_path, context=prompt + gen + 8, progress=False)
    ids = model.tokenizer.encode(TEXT)[:prompt]
    assert len(ids) == prompt, (len(ids), prompt)
    out = tmac.Session(model).generate(ids, max_tokens=gen, ignore_eos=True, temperature=0)
    assert len(out) == gen, len(out)
    with open("/proc/self/maps") as f, open(maps, "w") as g:
        g.write(f.read())


if __name__ == "__main__":
    main()
