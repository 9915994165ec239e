"""Text: the tokenizer, chat templates, generated ids as streamed text."""
