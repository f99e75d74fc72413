"""Users' own models trained through rayshard (`--model-factory`)."""
