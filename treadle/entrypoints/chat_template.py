"""`--chat-template`: a chat template from a file, or given as the template itself (vLLM's flag).

A model without a template (most base models), or one whose template drops what a client needs,
is served with a template of the user's. It is checked at start-up, before the model loads: a
path that does not exist or a template that does not parse is an error then, not a 400 on every
chat request later.
"""

from __future__ import annotations

import os

import jinja2

# What marks a value as a template rather than a path (vLLM's rule too).
_TEMPLATE_MARKS = ("{", "}", "\n")


def load_chat_template(value: str) -> str:
    """The template `value` names: a file's text, or `value` itself where it holds template
    syntax. Raises ValueError naming what is wrong."""
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                template = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template: cannot read {value}: {e}") from None
    elif any(mark in value for mark in _TEMPLATE_MARKS):
        template = value
    else:
        raise ValueError(f"--chat-template: {value!r} is neither a file nor a template "
                         "(a template holds {{ ... }} or {% ... %})")
    try:   # transformers renders with the loopcontrols extension; parse as it would
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template does not parse: line {e.lineno}: {e.message}") from None
    return template
