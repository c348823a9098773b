"""`treadle chat`: an interactive chat on the in-process engine, each reply streamed as it comes.

The REPL steps an `LLMEngine` itself, on the main thread. While a reply streams, Ctrl-C only
sets a flag (`_CtrlC`); the loop sees it between two engine steps and aborts the request, so
the engine is never interrupted mid-step and the request's KV blocks are freed. The stopped
exchange (the message and its partial reply) is left out of the conversation: the next
message is answered as if it had never been sent. A reply cut at max_tokens stays in the
conversation, and `/more` continues it.

A conversation that outgrows the context (its prompt plus max_tokens past max_model_len)
loses its oldest turns, a user message and its reply at a time, never the system prompt.
"""

from __future__ import annotations

import itertools
import signal
import sys
from types import FrameType
from typing import Any, Callable

import jinja2

from treadle.config import EngineArgs
from treadle.engine.llm_engine import LLMEngine
from treadle.sampling_params import RequestOutputKind, SamplingParams

try:   # line editing and history for input(), where the platform has it
    import readline  # noqa: F401
except ImportError:
    pass

HELP = """\
/help          this list
/reset         forget the conversation (the system prompt stays)
/more          continue a reply that was cut at max_tokens
/exit, /quit   leave (or Ctrl-D, or Ctrl-C twice at the prompt)
//text         send "/text" as a message
Ctrl-C during a reply stops it; the stopped exchange is left out of the conversation."""

Message = dict[str, str]


class _CtrlC:
    """While active, Ctrl-C sets `pressed` instead of raising KeyboardInterrupt."""

    def __init__(self) -> None:
        self.pressed = False
        self._previous: Any = None

    def __enter__(self) -> "_CtrlC":
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        signal.signal(signal.SIGINT, self._previous)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.pressed = True


def streaming_params(params: SamplingParams) -> SamplingParams:
    """`params` for a chat's replies: one sample, a max_tokens, text streamed as deltas."""
    if params.n != 1:
        raise ValueError(f"chat streams one reply at a time: n must be 1, got {params.n}")
    if params.max_tokens is None:
        raise ValueError("chat needs max_tokens, to fit the conversation to the context")
    params = params.clone()
    params.output_kind = RequestOutputKind.DELTA
    return params


class ChatSession:
    """One conversation on an engine: the history, fitting it to the context, streaming replies."""

    def __init__(self, engine: LLMEngine, params: SamplingParams, system: str | None = None,
                 write: Callable[[str], None] | None = None) -> None:
        self.engine = engine
        self.params = streaming_params(params)
        self.system: list[Message] = [{"role": "system", "content": system}] if system else []
        self.turns: list[Message] = []   # user, assistant, user, assistant, ...
        self.last_cut = False            # the last reply ended at max_tokens
        self.write = write or _write_stdout
        self._ids = itertools.count()

    @property
    def max_model_len(self) -> int:
        return self.engine.config.model.max_model_len

    # -- commands ------------------------------------------------------------------------
    def reset(self) -> None:
        forgotten = len(self.turns)
        self.turns.clear()
        self.last_cut = False
        kept = " (the system prompt stays)" if self.system else ""
        self.write(f"[conversation cleared: {forgotten} messages forgotten{kept}]\n")

    def send(self, text: str, stop: Callable[[], bool] = lambda: False) -> str | None:
        """Answer a user message, streaming the reply through `write`; None if not answered."""
        self.turns.append({"role": "user", "content": text})
        try:
            prompt = self._fit(keep=1, continue_final=False)
        except (jinja2.TemplateError, ValueError, TypeError) as e:
            # e.g. a template that refuses a system turn (Gemma 2, older Mistral): say so and
            # keep the session, not a traceback that ends it.
            self.turns.pop()
            self.write(f"[the chat template failed: {e}]\n")
            return None
        if prompt is None:
            self.turns.pop()
            return None
        reply, reason = self._stream(prompt, stop)
        if reason == "abort":
            self.turns.pop()
            self.write("[stopped; this exchange is left out of the conversation]\n")
            return None
        self.turns.append({"role": "assistant", "content": reply})
        self._after_reply(reason)
        return reply

    def more(self, stop: Callable[[], bool] = lambda: False) -> str | None:
        """Continue the last reply where max_tokens cut it; returns the added text."""
        if not self.last_cut:
            self.write("[nothing to continue: /more follows a reply cut at max_tokens]\n")
            return None
        prompt = self._fit(keep=2, continue_final=True)
        if prompt is None:
            return None
        added, reason = self._stream(prompt, stop)
        if reason == "abort":
            self.write("[stopped; the reply stays as it was before /more]\n")
            return None
        self.turns[-1]["content"] += added
        self._after_reply(reason)
        return added

    # -- the context ---------------------------------------------------------------------
    def _encode(self, messages: list[Message], continue_final: bool) -> dict[str, Any]:
        """The prompt for `messages`, built as `LLM.chat` builds it."""
        tokenizer = self.engine.tokenizer
        text = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=not continue_final,
                                             continue_final_message=continue_final)
        # The template already holds the special tokens; encoding must not add more.
        return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}

    def _fits(self, prompt: dict[str, Any]) -> bool:
        return len(prompt["prompt_token_ids"]) + self.params.max_tokens <= self.max_model_len

    def _fit(self, keep: int, continue_final: bool) -> dict[str, Any] | None:
        """The prompt for the conversation, its oldest turns dropped until it fits the context
        (the last `keep` messages and the system prompt always stay); None if even those do
        not fit, and the conversation is left as it was."""
        alone = self._encode(self.system + self.turns[-keep:], continue_final)
        if not self._fits(alone):
            what = "this message" if keep == 1 else "the reply so far"
            self.write(f"[{what} takes {len(alone['prompt_token_ids'])} tokens; with "
                       f"max_tokens={self.params.max_tokens} it does not fit the "
                       f"{self.max_model_len}-token context, so it is not sent]\n")
            return None
        dropped = 0
        prompt = self._encode(self.system + self.turns, continue_final)
        while not self._fits(prompt):
            del self.turns[:2]
            dropped += 1
            prompt = self._encode(self.system + self.turns, continue_final)
        if dropped:
            turns = "the oldest turn" if dropped == 1 else f"the {dropped} oldest turns"
            self.write(f"[dropped {turns} to fit the {self.max_model_len}-token context]\n")
        return prompt

    # -- generation ----------------------------------------------------------------------
    def _stream(self, prompt: dict[str, Any], stop: Callable[[], bool]) -> tuple[str, str]:
        """Generate for `prompt`, writing each new piece of text as the engine detokenizes it.
        Returns the text and the finish reason; "abort" when `stop()` said so between steps."""
        engine, request_id = self.engine, f"chat-{next(self._ids)}"
        engine.add_request(request_id, prompt, self.params)
        pieces: list[str] = []
        reason: str | None = None
        try:
            while reason is None:
                if stop():
                    engine.abort_request(request_id)
                    reason = "abort"
                    break
                for out in engine.step():
                    if out.request_id != request_id:
                        continue
                    completion = out.outputs[0]
                    if completion.text:
                        pieces.append(completion.text)
                        self.write(completion.text)
                    reason = completion.finish_reason
        except BaseException:
            engine.abort_request(request_id)
            raise
        self.write("\n")
        return "".join(pieces), reason

    def _after_reply(self, reason: str) -> None:
        self.last_cut = reason == "length"
        if self.last_cut:
            self.write(f"[cut at max_tokens={self.params.max_tokens}: /more continues it, "
                       "or raise --max-tokens]\n")


def _write_stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _with_ctrl_c(answer: Callable[[Callable[[], bool]], str | None]) -> None:
    """Run one reply with Ctrl-C stopping it (between two engine steps) instead of raising."""
    with _CtrlC() as ctrl_c:
        answer(lambda: ctrl_c.pressed)


def repl(session: ChatSession) -> int:
    """Read lines and answer them until /exit, Ctrl-D, or Ctrl-C twice at the prompt."""
    ctrl_c_at_prompt = False
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            _write_stdout("\n[bye]\n")
            return 0
        except KeyboardInterrupt:
            if ctrl_c_at_prompt:
                _write_stdout("\n[bye]\n")
                return 0
            ctrl_c_at_prompt = True
            _write_stdout("\n[Ctrl-C again, Ctrl-D or /exit to leave]\n")
            continue
        ctrl_c_at_prompt = False
        if not line:
            continue
        if line.startswith("//"):
            message = line[1:]
        elif line.startswith("/"):
            command = line.split()[0]
            if command in ("/exit", "/quit"):
                _write_stdout("[bye]\n")
                return 0
            if command == "/help":
                _write_stdout(HELP + "\n")
            elif command == "/reset":
                session.reset()
            elif command == "/more":
                _with_ctrl_c(session.more)
            else:
                _write_stdout(f"[unknown command {command}; /help lists them]\n")
            continue
        else:
            message = line
        _with_ctrl_c(lambda stop: session.send(message, stop))


def run_chat(engine_args: dict[str, Any], params: SamplingParams, system: str | None,
             chat_template: str | None = None) -> int:
    """`treadle chat`: load the model, then talk until the user leaves (`chat_template`: in
    place of the tokenizer's). Returns the exit status."""
    streaming_params(params)   # a bad flag is refused before the model loads
    try:
        engine = LLMEngine.from_engine_args(EngineArgs(**engine_args))
    except KeyboardInterrupt:
        _write_stdout("\n")
        return 130
    if chat_template is not None:
        engine.tokenizer.chat_template = chat_template
    try:
        session = ChatSession(engine, params, system)
        _write_stdout(f"treadle chat: {engine.config.model.max_model_len}-token context, "
                      f"max_tokens={params.max_tokens}. /help lists the commands.\n")
        return repl(session)
    except KeyboardInterrupt:   # Ctrl-C between a reply and the prompt
        _write_stdout("\n[bye]\n")
        return 0
    finally:
        engine.core.shutdown()
