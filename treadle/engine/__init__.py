"""The engine: the core step loop, the offline LLM API, input and output processing."""
