"""`treadle chat` in a real terminal: tmux runs it, the tests type keys and read the screen.

One chat session (the embedded model, fp32, greedy, a 160-token context and max_tokens=64)
goes through the checks in order, each test taking the conversation from where the last left
it; a second one only checks that Ctrl-D leaves. Both start, and the reference `LLM` loads,
at once, so the loads overlap.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

from treadle import LLM, SamplingParams
from treadle.entrypoints.chat import ChatSession

TREADLE = str(Path(sys.executable).parent / "treadle")
TMUX = shutil.which("tmux")
CONTEXT, MAX_TOKENS = 160, 64
# A KV cache of its own size for each engine: on a GPU, three engines that each sized theirs to
# the free memory would not fit beside each other. 16 blocks hold the context on GPU and CPU.
KV_BLOCKS = 16
CHAT_FLAGS = ["--dtype", "float32", "--temperature", "0", "--max-tokens", str(MAX_TOKENS),
              "--max-model-len", str(CONTEXT), "--num-kv-blocks", str(KV_BLOCKS)]
LOAD_DEADLINE_S = 180   # a loaded 2-core machine; an idle one loads in about 15 s


class Terminal:
    """A program in a detached tmux session, on a tmux server of its own (at `socket`)."""

    def __init__(self, socket: Path, argv: list[str]) -> None:
        self.socket = str(socket)
        # bash writes the exit status on the screen: tmux 3.3a's #{pane_dead_status} is at
        # times never set (its server misses the child's exit, which stays a zombie).
        command = shlex.join(["env", "OMP_NUM_THREADS=1", *argv]) + '; echo "[exit status $?]"'
        self._tmux("-f", "/dev/null", "new-session", "-d", "-x", "200", "-y", "50",
                   "bash", "-c", command)
        # Keep the pane after bash exits, to read the last screen.
        self._tmux("set-option", "-g", "remain-on-exit", "on")
        self.last_line = ""   # the last line typed, as the screen shows it after the prompt

    def _tmux(self, *args: str) -> str:
        return subprocess.run([TMUX, "-S", self.socket, *args], check=True, capture_output=True,
                              text=True).stdout

    def type(self, text: str) -> None:
        """Type a line and press Enter."""
        self.last_line = ("> " + text).rstrip()
        self._tmux("send-keys", "-l", text)
        self._tmux("send-keys", "Enter")

    def key(self, key: str) -> None:
        self._tmux("send-keys", key)

    def screen(self) -> str:
        """Everything the program wrote, scrollback included: wrapped lines joined, and
        without the trailing spaces (which -J keeps) and the empty lines below."""
        text = self._tmux("capture-pane", "-p", "-J", "-S", "-")
        return "\n".join(line.rstrip() for line in text.splitlines()).rstrip("\n")

    def exit_status(self) -> int | None:
        """The program's exit status; None while it runs."""
        found = re.search(r"^\[exit status (\d+)\]$", self.screen(), re.MULTILINE)
        return int(found.group(1)) if found else None

    def wait_for(self, ready: Callable[[str], bool], what: str, timeout: float = 30) -> str:
        """The screen once `ready(screen)`; fails, showing the screen, at the deadline or
        when the program has exited without it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            exited = self.exit_status() is not None
            screen = self.screen()
            if ready(screen):
                return screen
            if exited:
                break
            time.sleep(0.05)
        pytest.fail(f"waited for {what}; the screen:\n{self.screen()}")

    def wait_for_prompt(self, timeout: float = 30) -> str:
        """The screen once the last line typed has been answered and the prompt is back."""
        def answered(screen: str) -> bool:
            return at_prompt(screen) and self.last_line in screen.splitlines()[:-1]
        return self.wait_for(answered, f"an answer to {self.last_line!r}", timeout)

    def close(self) -> None:
        subprocess.run([TMUX, "-S", self.socket, "kill-server"], capture_output=True)


def at_prompt(screen: str) -> bool:
    """The program waits at its prompt (the screen's last line)."""
    return screen.splitlines()[-1:] == [">"]


def after(screen: str, line: str) -> list[str]:
    """The lines after the last one equal to `line`."""
    lines = screen.splitlines()
    index = len(lines) - 1 - lines[::-1].index(line)
    return lines[index + 1:]


def reply_to(screen: str, message: str) -> str:
    """The reply on screen to `message`: after the notices that come first, the lines up to
    the next prompt or notice."""
    lines = after(screen, "> " + message)
    while lines and lines[0].startswith("["):
        lines.pop(0)
    reply = []
    for line in lines:
        if line.startswith(">") or line.startswith("["):
            break
        reply.append(line)
    return "\n".join(reply)


def as_on_screen(text: str) -> str:
    """What a terminal shows of a reply: no trailing spaces on a line, no trailing newlines."""
    return "\n".join(line.rstrip() for line in text.splitlines()).rstrip("\n")


@pytest.fixture(scope="module")
def terminals(tmp_path_factory):
    if TMUX is None:   # never a skip: `make test` installs it (make terminal)
        pytest.fail("tmux is missing: `make terminal` installs it")
    sockets = tmp_path_factory.mktemp("tmux")
    chat = Terminal(sockets / "chat", [TREADLE, "chat", *CHAT_FLAGS])
    ctrl_d = Terminal(sockets / "ctrl-d", [TREADLE, "chat", *CHAT_FLAGS])
    yield chat, ctrl_d
    chat.close()
    ctrl_d.close()


@pytest.fixture(scope="module")
def term(terminals) -> Terminal:
    return terminals[0]


@pytest.fixture(scope="module")
def reference(terminals):
    """The offline API on the same model, loaded while the chats load."""
    with LLM(dtype="float32", num_kv_blocks=KV_BLOCKS) as llm:
        yield llm


def greedy(llm: LLM, conversation: list[dict[str, str]]) -> str:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    return llm.chat(conversation, params, use_tqdm=False)[0].outputs[0].text


def test_it_starts_and_help_lists_the_commands(term, reference):
    # `reference` is asked for here only so that it loads while the chats load.
    term.wait_for(at_prompt, "the first prompt", timeout=LOAD_DEADLINE_S)
    term.type("/help")
    screen = term.wait_for_prompt()
    for command in ("/help", "/reset", "/more", "/exit", "/quit", "//text", "Ctrl-C"):
        assert command in "\n".join(after(screen, "> /help"))


def test_an_unknown_command_is_refused_not_sent(term):
    term.type("/foo bar")
    screen = term.wait_for_prompt()
    assert after(screen, "> /foo bar") == ["[unknown command /foo; /help lists them]", ">"]


def test_replies_are_exactly_what_llm_chat_returns(term, reference):
    first, second = "What is the capital of France?", "And of Germany?"
    term.type(first)
    term.wait_for_prompt(timeout=60)
    term.type(second)
    screen = term.wait_for_prompt(timeout=60)
    expected_first = greedy(reference, [{"role": "user", "content": first}])
    expected_second = greedy(reference, [{"role": "user", "content": first},
                                         {"role": "assistant", "content": expected_first},
                                         {"role": "user", "content": second}])
    assert "Paris" in expected_first
    assert reply_to(screen, first) == as_on_screen(expected_first)
    assert reply_to(screen, second) == as_on_screen(expected_second)


def test_reset_says_what_it_did(term):
    term.type("/reset")
    screen = term.wait_for_prompt()
    assert after(screen, "> /reset")[0] == "[conversation cleared: 4 messages forgotten]"


def test_a_reply_streams_and_says_when_max_tokens_cuts_it(term):
    message = "Write a long story about a dragon."
    term.type(message)
    seen: list[str] = []   # the reply's text at each capture, while it was still coming
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        screen = term.screen()
        if "> " + message in screen:
            if at_prompt(screen):
                break
            text = reply_to(screen, message)
            if text and (not seen or text != seen[-1]):
                seen.append(text)
        time.sleep(0.02)
    final = reply_to(screen, message)
    # Seen part by part, each a prefix of the next: the text came as it was generated.
    assert len(seen) >= 3, seen
    for shorter, longer in zip(seen, seen[1:] + [final]):
        assert longer.startswith(shorter.rstrip()), (shorter, longer)
    assert len(seen[0]) < len(final) / 2
    assert f"[cut at max_tokens={MAX_TOKENS}: /more continues it, or raise --max-tokens]" \
        in after(screen, "> " + message)


def test_ctrl_c_stops_a_reply_and_keeps_the_session(term, reference):
    # The story above (about 37 + 64 tokens) and this message leave no room for 64 more.
    message = "Write a long story about a cat."
    term.type(message)
    term.wait_for(lambda s: "> " + message in s and reply_to(s, message), "the reply to start")
    term.key("C-c")
    screen = term.wait_for_prompt()
    shown = after(screen, "> " + message)
    assert shown[0] == f"[dropped the oldest turn to fit the {CONTEXT}-token context]"
    assert "[stopped; this exchange is left out of the conversation]" in shown
    assert not any(line.startswith("[cut at") for line in shown)
    # The story was dropped and the stopped exchange left out: a new conversation.
    term.type("What is 2+2?")
    screen = term.wait_for_prompt()
    assert reply_to(screen, "What is 2+2?") == as_on_screen(
        greedy(reference, [{"role": "user", "content": "What is 2+2?"}]))


def test_a_message_too_long_for_the_context_is_not_sent(term):
    message = "word " * 120
    term.type(message)
    screen = term.wait_for_prompt()
    notice = after(screen, "> " + message.strip())[0]
    assert f"does not fit the {CONTEXT}-token context, so it is not sent]" in notice
    term.type("/more")
    screen = term.wait_for_prompt()
    assert after(screen, "> /more")[0].startswith("[nothing to continue")


def test_ctrl_c_twice_at_the_prompt_leaves_cleanly(term):
    term.key("C-c")
    term.wait_for(lambda s: "[Ctrl-C again, Ctrl-D or /exit to leave]" in s, "the hint")
    term.key("C-c")
    screen = term.wait_for(lambda s: term.exit_status() is not None, "the exit", timeout=60)
    assert term.exit_status() == 0
    assert "Traceback" not in screen and "[bye]" in screen


def test_ctrl_d_leaves_cleanly(terminals):
    ctrl_d = terminals[1]
    ctrl_d.wait_for(at_prompt, "the first prompt", timeout=LOAD_DEADLINE_S)
    ctrl_d.key("C-d")
    screen = ctrl_d.wait_for(lambda s: ctrl_d.exit_status() is not None, "the exit", timeout=60)
    assert ctrl_d.exit_status() == 0
    assert "Traceback" not in screen and "[bye]" in screen


def test_a_stopped_reply_frees_its_kv_blocks(reference):
    """In process: the request stopped between steps is aborted in the engine."""
    pieces: list[str] = []
    session = ChatSession(reference.engine, SamplingParams(temperature=0.0, max_tokens=32),
                          write=pieces.append)
    assert session.send("Write a long story about a loom.", stop=lambda: len(pieces) >= 3) is None
    assert pieces[-1] == "[stopped; this exchange is left out of the conversation]\n"
    assert session.turns == []
    stats = reference.get_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage) == (0, 0, 0.0)
    assert not reference.engine.has_unfinished_requests()


def test_more_continues_a_cut_reply(reference):
    """In process: /more appends to the cut reply, which stays one assistant message."""
    pieces: list[str] = []
    session = ChatSession(reference.engine, SamplingParams(temperature=0.0, max_tokens=8),
                          write=pieces.append)
    first = session.send("Write a long story about a loom.")
    assert session.last_cut and pieces[-1].startswith("[cut at max_tokens=8")
    added = session.more()
    assert added and session.last_cut
    assert [m["role"] for m in session.turns] == ["user", "assistant"]
    assert session.turns[-1]["content"] == first + added


def test_overflow_drops_the_oldest_turns_but_never_the_system_prompt(reference):
    """In process: the system prompt stays when turns go to fit the context."""
    pieces: list[str] = []
    session = ChatSession(reference.engine, SamplingParams(temperature=0.0, max_tokens=1),
                          system="You answer in one word.", write=pieces.append)
    context = session.max_model_len
    long = "word " * (context // 3)   # three of these outgrow the context
    session.turns = [{"role": "user", "content": long}, {"role": "assistant", "content": long},
                     {"role": "user", "content": "Hi"}, {"role": "assistant", "content": long}]
    assert session.send("Hello") is not None
    assert pieces[0] == f"[dropped the oldest turn to fit the {context}-token context]\n"
    assert [m["content"] for m in session.turns[:2]] == ["Hi", long]
    assert session.system == [{"role": "system", "content": "You answer in one word."}]


REFUSES_SYSTEM = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_that_fails_says_so_and_the_session_goes_on(reference):
    """In process: a template that refuses a system turn (Gemma 2's, older Mistral ones) once
    ended the chat with a jinja2 traceback at the first message."""
    tokenizer = reference.engine.tokenizer
    saved, tokenizer.chat_template = tokenizer.chat_template, REFUSES_SYSTEM
    try:
        pieces: list[str] = []
        session = ChatSession(reference.engine, SamplingParams(temperature=0.0, max_tokens=2),
                              system="You answer in one word.", write=pieces.append)
        assert session.send("Hello") is None
        assert pieces[-1] == "[the chat template failed: System role not supported]\n"
        assert session.turns == []
        session.system = []
        assert session.send("Hello") is not None and len(session.turns) == 2
    finally:
        tokenizer.chat_template = saved
