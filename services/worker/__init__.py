"""The worker: owns the model weights and the paged KV cache; runs one forward pass per step."""
