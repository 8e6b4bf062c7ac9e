"""The device: the provider, buffers on it, its memory readings and the session factory."""
