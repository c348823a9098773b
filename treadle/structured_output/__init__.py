"""Structured outputs: constrain what a request may generate to a JSON schema, a regex, a
choice or a grammar.

  params.py     StructuredOutputsParams, what a request asks for
  backend.py    the grammar engines' common interface (xgrammar_backend, guidance_backend)
  registry.py   the engines by name, and one backend per process and model
  gate.py       engine core: holds a request until its grammar is compiled, off the step path
  reasoning.py  with a reasoning parser, a grammar binds once the reasoning has ended
  worker/grammar.py (beside the sampler): matchers per request slot, and the token bitmask
"""
