"""A small GPT-2-style model brought as a user's own code: `--model-factory examples.gpt2.model:tiny_gpt2`."""
