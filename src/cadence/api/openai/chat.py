"""Chat messages to one prompt: the checkpoint's own chat template, or a plain format.

The torch and transformers engines with a Hugging Face folder render `messages` with the
folder's template (`chat_template.jinja`, else `tokenizer_config.json`'s `chat_template`; of a
list of named templates, `default`) the way transformers' `apply_chat_template` does: jinja2's
sandboxed environment with `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension,
`raise_exception` and `strftime_now`, a `tojson` filter, the variables `messages`,
`add_generation_prompt=True`, `bos_token` and `eos_token`. The worker's tokenizer adds the
special tokens its tokenizer.json adds (a BOS for Llama), so a BOS the template writes first
is dropped when the tokenizer would add it again.

Everything else (the synthetic and app engines, `--model tiny`, a folder without a template)
uses the plain format, one line per message and an open assistant turn:

    system: You are terse.
    user: Hello
    assistant:
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from cadence.config import ServerConfig


class PlainChat:
    """`role: content` lines, then `assistant:` (see the module docstring)."""

    source = "plain"

    def render(self, messages: list[dict[str, str]]) -> str:
        lines = [f"{m['role']}: {m['content']}" for m in messages]
        return "\n".join(lines) + "\nassistant:"


class TemplateChat:
    """A checkpoint's jinja2 chat template, rendered as transformers renders it."""

    def __init__(
        self,
        template: str,
        bos_token: str = "",
        eos_token: str = "",
        *,
        drop_bos: bool = False,
        source: str = "",
    ) -> None:
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise ValueError(f"the chat template refused the messages: {message}")

        def tojson(value: Any, indent: int | None = None, **_: Any) -> str:
            return json.dumps(value, indent=indent, ensure_ascii=False)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._template = env.from_string(template)
        self._bos = bos_token
        self._eos = eos_token
        self._drop_bos = drop_bos and bool(bos_token)
        self.source = source

    def render(self, messages: list[dict[str, str]]) -> str:
        text = self._template.render(
            messages=messages, add_generation_prompt=True, bos_token=self._bos, eos_token=self._eos
        )
        if self._drop_bos and text.startswith(self._bos):
            text = text[len(self._bos) :]
        return text


def _token_text(value: Any) -> str:
    """A special token of tokenizer_config.json: a string or `{"content": ...}`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _tokenizer_adds(folder: Path, token: str) -> bool:
    """Whether the folder's tokenizer.json adds `token` when it encodes a prompt."""
    if not token or not (folder / "tokenizer.json").exists():
        return False
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return False
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    token_id = tokenizer.token_to_id(token)
    ids = tokenizer.encode("a").ids
    return token_id is not None and bool(ids) and ids[0] == token_id


def load_template(folder: str | Path) -> TemplateChat | None:
    """The folder's chat template, or None when it has none."""
    folder = Path(folder)
    config: dict[str, Any] = {}
    config_path = folder / "tokenizer_config.json"
    if config_path.exists():
        config = json.loads(config_path.read_text(encoding="utf-8"))
    jinja_path = folder / "chat_template.jinja"
    template: object
    if jinja_path.exists():
        template, source = jinja_path.read_text(encoding="utf-8"), str(jinja_path)
    else:
        template, source = config.get("chat_template"), str(config_path)
        if isinstance(template, list):  # named templates
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
    if not isinstance(template, str) or not template:
        return None
    bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
    return TemplateChat(template, bos, eos, drop_bos=_tokenizer_adds(folder, bos), source=source)


def chat_format(config: ServerConfig) -> TemplateChat | PlainChat:
    """How this server turns messages into a prompt (see the module docstring)."""
    engine = config.engine
    if engine.name in ("torch", "transformers") and engine.model and Path(engine.model).is_dir():
        template = load_template(engine.model)
        if template is not None:
            return template
    return PlainChat()
