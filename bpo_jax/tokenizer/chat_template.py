"""A checkpoint's chat template, rendered as Hugging Face's `apply_chat_template` renders it.

Instruct checkpoints ship a Jinja2 template (`chat_template` in `tokenizer_config.json`, or a
`chat_template.jinja` file beside it, which takes priority, as in transformers) that turns a
list of messages into the exact text the model was tuned on. Rendering it the way transformers
does matters: a stray newline or a missing header token is a different prompt distribution.
What is reproduced here (transformers 4.5x-5.x, `utils/chat_template_utils.py`):

* an `ImmutableSandboxedEnvironment` (templates from the Hub are untrusted code) with
  `trim_blocks=True`, `lstrip_blocks=True` and the `loopcontrols` extension;
* the `{% generation %}` block tag (rendered as its body; it only marks assistant spans);
* globals `raise_exception` (raises `jinja2.TemplateError`), `strftime_now`, a restricted `dict`
  and a `namespace` that refuses underscore-prefixed names; a `tojson` filter that does not
  escape HTML characters;
* the render variables `messages`, `tools`, `documents`, `add_generation_prompt`, and the named
  special tokens as strings (`bos_token`, `eos_token`, `pad_token`, ...; absent when unset).

The rendered text is tokenised without adding special tokens (the template writes them), which
is what `apply_chat_template(..., tokenize=True)` does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from etils import epath

CHAT_TEMPLATE_FILE = "chat_template.jinja"
# transformers' `SPECIAL_TOKENS_ATTRIBUTES`: the named special tokens a template can read.
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def _environment():
    """The sandboxed Jinja2 environment transformers compiles chat templates in."""
    import jinja2  # Local: only chat-format agents need it.
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`: marks an assistant span; renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_render_body")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _render_body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    class TemplateDict:
        """`dict(...)` and `dict.fromkeys(...)`, without the type's other attributes."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace, got "
                f"{name!r}."
            )

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):  # Jinja's own signature trick: `namespace(self=...)`.
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env


def _plain(value: Any) -> Any:
    """Messages as plain JSON values (what transformers hands the template; no rich objects)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    raise TypeError(f"chat messages hold JSON values only, got {type(value).__name__}: {value!r}.")


class ChatTemplate:
    """A compiled chat template and the special-token strings it is rendered with.

    Args:
      source: The template's Jinja2 text.
      special_tokens: Named special tokens (`bos_token`, `eos_token`, ...) to their strings;
        names whose token is unset are left out, as transformers leaves them out.
      origin: Where the template came from (for messages).

    Raises:
      jinja2.TemplateSyntaxError: If the template does not compile.
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str], origin: str = "<string>"):
        self.source = source
        self.origin = origin
        self.special_tokens = dict(special_tokens)
        self._template = _environment().from_string(source)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """The conversation as the model's prompt text.

        Args:
          messages: `{"role": ..., "content": ...}` dicts; keys whose value is None are dropped
            (transformers drops them: many templates test for a key's presence).
          add_generation_prompt: End with the header that starts the assistant's turn.
          **kwargs: Extra template variables (they override the special tokens).

        Raises:
          ValueError: For an empty conversation.
          jinja2.TemplateError: What the template raises (`raise_exception`).
        """
        if not messages:
            raise ValueError("cannot render an empty conversation; give at least one message.")
        chat = [_plain({k: v for k, v in m.items() if v is not None}) for m in messages]
        variables = _plain({**self.special_tokens, **kwargs})
        return self._template.render(
            messages=chat,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )

    @classmethod
    def from_folder(
        cls, folder: epath.Path, tok_config: Mapping[str, Any], special_tokens: Mapping[str, str]
    ) -> ChatTemplate | None:
        """The template of a tokenizer folder, or None when it has none.

        `chat_template.jinja` wins over `tokenizer_config.json`'s `chat_template`, which may be
        a string or a list of `{"name", "template"}` (then the one named "default").

        Raises:
          ValueError: If the config's `chat_template` has a form that cannot be read.
        """
        path = folder / CHAT_TEMPLATE_FILE
        if path.is_file():
            return cls(path.read_text(encoding="utf-8"), special_tokens, str(path))
        origin = f"{folder / 'tokenizer_config.json'} (chat_template)"
        return cls.from_config(tok_config, special_tokens, origin)

    @classmethod
    def from_config(
        cls, tok_config: Mapping[str, Any], special_tokens: Mapping[str, str], origin: str
    ) -> ChatTemplate | None:
        """The template of a tokenizer config's `chat_template` (a string, or a list of
        `{"name", "template"}` of which the one named "default"), or None when it has none.

        Raises:
          ValueError: If `chat_template` has a form that cannot be read.
        """
        value = tok_config.get("chat_template")
        if value is None:
            return None
        if isinstance(value, str):
            return cls(value, special_tokens, origin)
        if isinstance(value, list) and all(isinstance(t, dict) for t in value):
            named = {t.get("name"): t.get("template") for t in value}
            if isinstance(named.get("default"), str):
                return cls(named["default"], special_tokens, origin + "[default]")
        raise ValueError(
            f"{origin} must be a template string or a list of {{'name', 'template'}} with a "
            f"'default' one, got {value!r:.200}."
        )
