"""CPU training utilities: the embedded world model, and (later) method components trained on it."""
