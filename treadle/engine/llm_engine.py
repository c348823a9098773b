"""LLMEngine: a synchronous engine — input processing, the core step loop, output processing."""

from __future__ import annotations

import logging
from typing import Any

from treadle.config import EngineArgs, TreadleConfig
from treadle.core.scheduler_output import EngineCoreOutput
from treadle.engine.core import EngineCore
from treadle.engine.input_processor import InputProcessor, PromptType
from treadle.engine.output_processor import OutputProcessor
from treadle.models.loader import load_tokenizer
from treadle.outputs import RequestOutput
from treadle.request import RequestStatus
from treadle.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: TreadleConfig) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config.model.model)
        self.core = EngineCore(config)
        self.input_processor = InputProcessor(config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args.create_config())

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    priority: int = 0, cache_salt: str | None = None) -> None:
        text, ids = self.input_processor.tokenize(prompt)
        text, ids = self.input_processor.truncate(text, ids, params)
        requests = self.input_processor.make_requests(request_id, ids, params, priority, cache_salt,
                                                      prompt_text=text)
        # The output processor refuses an id in use (its samples' ids too) before the core sees it.
        self.output_processor.add_request(request_id, text, ids, params, [r.request_id for r in requests])
        try:
            self.core.add_requests(requests)
        except Exception:
            self.output_processor.abort_request(request_id)
            raise

    def step(self) -> list[RequestOutput]:
        # Outputs held since a drain go out first, each labelled with the weights that made
        # it: a weight change may have come since.
        ready = [out for weights, held in self.core.take_held_outputs()
                 for out in self._process(held, weights.label)]
        return ready + self._process(self.core.step(), self.core.weight_version)

    def _process(self, outputs: list[EngineCoreOutput], weight_version: Any) -> list[RequestOutput]:
        ready, stopped = self.output_processor.process_outputs(outputs, weight_version)
        if stopped:
            self.core.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return ready

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        finals = []
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            final, engine_ids = self.output_processor.abort_request(rid)
            self.core.abort_requests(engine_ids)
            if final is not None:
                finals.append(final)
        return finals

    def has_unfinished_requests(self) -> bool:
        # And aborted requests' KV loads: they hold blocks until a step hears they ended (as the
        # server's engine thread steps on). Not sends: a remote reader may never come.
        return (self.output_processor.has_unfinished_requests()
                or bool(self.core.scheduler.free_after_load))

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return self.core.reset_prefix_cache(reset_running_requests)
