"""Models (Llama family), their loaders (GGUF), tokenizer and generation. ``tmac.load_model`` is the entry point."""
