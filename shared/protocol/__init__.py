"""Messages of every channel (one module per channel) and the one codec."""
