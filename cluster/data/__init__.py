"""Tokenizers and prepared datasets on the driver: `rayshard data tokenizer train` and `data prepare`."""
