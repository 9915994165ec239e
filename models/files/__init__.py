"""Model files in and out: GGUF, Hugging Face, GPTQ, .tmac, the hub, packed copies, synthetic files."""
