"""`ChatTemplate`: a model's chat template (`chat_template` in `tokenizer_config.json`, Jinja2)
rendered in a sandbox: a template is data that came with a checkpoint, so it gets no access to
Python internals (attributes starting with `_`, unsafe callables) and its output is bounded.

The variables are those Hugging Face templates expect: `messages` (each with `role` and
`content`), `add_generation_prompt`, `bos_token`, `eos_token`, and `raise_exception(message)`,
which a template calls to refuse a conversation (the client gets a 400 with that message).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

MAX_RENDERED_CHARS = 4 << 20


class TemplateError(ValueError):
    """The conversation cannot be rendered (the message says why)."""


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str
    name: str | None = None

    def as_dict(self) -> dict:
        return {"role": self.role, "content": self.content, **({"name": self.name} if self.name else {})}


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        from jinja2 import StrictUndefined
        from jinja2.exceptions import TemplateSyntaxError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=StrictUndefined,
                                            autoescape=False)
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
        try:
            self._template = env.from_string(source)
        except TemplateSyntaxError as e:
            raise ValueError(f"chat_template does not parse: {e}") from None
        self.bos_token, self.eos_token = bos_token, eos_token

    @classmethod
    def from_dir(cls, path: str | Path) -> ChatTemplate | None:
        """The template of the checkpoint at `path`, or None when it has none."""
        cfg_path = Path(path) / "tokenizer_config.json"
        if not cfg_path.is_file():
            return None
        cfg = json.loads(cfg_path.read_text())
        source = cfg.get("chat_template")
        if isinstance(source, list):  # the named-templates form: [{"name": "default", "template": ...}]
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
        if not isinstance(source, str) or not source:
            return None
        return cls(source, _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token")))

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> str:
        from jinja2.exceptions import SecurityError, TemplateError as JinjaError

        try:
            text = self._template.render(messages=[m.as_dict() for m in messages],
                                         add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token)
        except TemplateError:
            raise
        except SecurityError as e:
            raise TemplateError(f"the chat template tried something its sandbox forbids: {e}") from None
        except JinjaError as e:
            raise TemplateError(f"the chat template failed on these messages: {e}") from None
        if len(text) > MAX_RENDERED_CHARS:
            raise TemplateError(f"the rendered conversation has over {MAX_RENDERED_CHARS} characters")
        return text


def _raise(message: str):
    raise TemplateError(str(message))


def _token_text(token: object) -> str:
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else ""
