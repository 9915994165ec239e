"""Models (every family in ``arch.py``, one ``Transformer``), their loaders (GGUF, Hugging Face, .tmac), tokenizer
and generation. ``tmac.load_model`` is the entry point."""
