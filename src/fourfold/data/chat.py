"""Conversations rendered with a model's own chat template, as transformers' `apply_chat_template`
renders them: the template from the model's directory (chat_template.jinja as transformers 5 saves
it, a named one in additional_chat_templates/, chat_template.json, or tokenizer_config.json's
`chat_template`), run in Jinja's immutable sandbox (a template from the Hub is untrusted: it reads
no attribute starting with "_", calls nothing unsafe and changes none of its inputs) with transformers'
settings (blocks trimmed, loop controls, `tojson` without HTML escaping, `raise_exception`,
`strftime_now`) and the tokenizer's special tokens (bos_token, eos_token, ...) as variables.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

TEMPLATE_FILE = "chat_template.jinja"
NAMED_TEMPLATES = "additional_chat_templates"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def template_of(folder: str | Path, name: str = "default") -> str | None:
    """The chat template named `name` ("default": the model's own) in a model directory, or None."""
    folder = Path(folder)
    if name != "default" and (folder / NAMED_TEMPLATES / f"{name}.jinja").is_file():
        return (folder / NAMED_TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
    if name == "default" and (folder / TEMPLATE_FILE).is_file():
        return (folder / TEMPLATE_FILE).read_text(encoding="utf-8")
    for source in ("chat_template.json", "tokenizer_config.json"):
        path = folder / source
        found = json.loads(path.read_text(encoding="utf-8")).get("chat_template") if path.is_file() else None
        if isinstance(found, list):  # [{"name": ..., "template": ...}] as older transformers wrote several
            found = next((t["template"] for t in found if t.get("name") == name), None)
        elif name != "default":  # a single template is the default one
            found = None
        if found is not None:
            return found
    return None


def special_tokens(folder: str | Path) -> dict[str, str]:
    """The tokenizer's special tokens by role (the template's bos_token, eos_token, ...), from
    tokenizer_config.json and special_tokens_map.json."""
    out: dict[str, str] = {}
    for source in ("special_tokens_map.json", "tokenizer_config.json"):
        path = Path(folder) / source
        settings = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        for role in SPECIAL_TOKENS:
            token = settings.get(role)
            if isinstance(token, dict):
                token = token.get("content")
            if isinstance(token, str):
                out[role] = token
    return out


def _sandbox():
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` (training templates mark the assistant's output so):
        rendered as its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
    return env


def render(template: str, messages: list[dict], *, tools: list[dict] | None = None, add_generation_prompt: bool = False,
           special: dict[str, str] | None = None) -> str:
    """The text of `messages` (each {"role", "content", ...}: plain JSON data) under `template`;
    `add_generation_prompt`: followed by what opens the assistant's next turn. ValueError with the
    template's own message when it refuses the conversation."""
    import jinja2

    try:
        compiled = _sandbox().from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not parse (line {e.lineno}: {e.message}); give the model's own "
                         f"template") from None
    try:
        return compiled.render(messages=messages, tools=tools, documents=None,
                               add_generation_prompt=add_generation_prompt, **(special or {}))
    except jinja2.exceptions.TemplateError as e:  # (raise_exception: what the template says of the conversation)
        raise ValueError(f"the chat template refuses this conversation: {e}") from None
