"""strata-tiny: the embedded default model's training pipeline (see tools/train_tiny.py, docs/strata-tiny.md)."""
