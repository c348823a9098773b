"""`--chat-template`: a chat template from a file, or given as the template itself (vLLM's flag).

A model without a template (most base models), or one whose template drops what a client needs,
is served with a template of the user's. It is checked at start-up, before the model loads: a
path that does not exist or a template that does not parse is an error then, not a 400 on every
chat request later.
"""

from __future__ import annotations

import os

import jinja2
import jinja2.ext

# What marks a value as a template rather than a path (vLLM's rule too).
_TEMPLATE_MARKS = ("{", "}", "\n")


class _GenerationTag(jinja2.ext.Extension):
    """transformers' {% generation %} ... {% endgeneration %} (it marks the assistant's tokens
    for training), which it adds to jinja: parsed here as its body, for the check only."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


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
    try:   # with the extensions transformers renders with
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols", _GenerationTag]).parse(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template does not parse: line {e.lineno}: {e.message}") from None
    return template
