"""The caches: the bounded variant cache, the sessions hung off it and their CUDA graphs."""
