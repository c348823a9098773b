"""Speculative decoding: draft proposers for the model runner."""
