"""Running a model: the decode plan, generation, batching, sampling, sequences, perplexity, its kernels."""
