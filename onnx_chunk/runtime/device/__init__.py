"""The device: the provider, buffers on it, its memory readings, the session factory and the
model edit behind its row-selecting sessions."""
