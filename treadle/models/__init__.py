"""Model code, the architecture registry, and the loader."""
