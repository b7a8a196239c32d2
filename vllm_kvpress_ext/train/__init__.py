"""Training: the default model (`kvpress train-model`)."""
