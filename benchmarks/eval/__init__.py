"""Quality evaluations: the real default model and its demo adapters, and the cost of a quantized base."""
