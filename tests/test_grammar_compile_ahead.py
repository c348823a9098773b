"""Worker processes (the mp executor) start compiling a constrained request's grammar when the
request arrives, beside the engine core's own compile, so that its first step does not compile
it again (structured_output/compile_ahead.py)."""

from __future__ import annotations

import threading

from treadle import LLM, SamplingParams
from treadle.request import Request

from tests.test_grammar_gate import slow_schema


def _compiling_ahead(worker) -> int:
    """How many grammars this worker compiles ahead now (module-level: it runs in the worker)."""
    return sum(t.name == "treadle-grammar-ahead" for t in threading.enumerate())


def test_a_worker_compiles_a_grammar_as_its_request_arrives(smollm2_path):
    llm = LLM(smollm2_path, max_model_len=256, block_size=16, num_kv_blocks=64,
              distributed_executor_backend="mp")
    try:
        core, tokenizer = llm.engine.core, llm.get_tokenizer()
        params = SamplingParams(max_tokens=2, structured_outputs={"json": slow_schema()})
        core.add_request(Request("a", tokenizer.encode("Reply with JSON."), params,
                                 tokenizer.eos_token_id))
        # Seconds before the engine core's own compile lets the request be scheduled.
        assert "a" in core.grammars and llm.collective_rpc(_compiling_ahead) == [1]
        outputs = []
        while core.has_unfinished_requests():
            outputs += core.step()
        assert outputs[-1].finish_reason == "length"
        assert "".join(tokenizer.decode(o.new_token_ids) for o in outputs).startswith("{")
    finally:
        llm.shutdown()
