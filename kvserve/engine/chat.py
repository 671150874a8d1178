"""Chat prompts: messages rendered by the model's chat template, as token ids.

One helper for every caller that turns messages into a prompt (``/v1/chat/completions``,
``Engine.chat``, ``kvserve generate --chat``), so they build the same ids.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def chat_prompt_ids(tokenizer: Any, messages: Sequence[Mapping[str, str]]) -> list[int]:
    """Token ids of ``messages`` (``{"role", "content"}`` dicts, OpenAI's roles) rendered
    by the tokenizer's chat template with the assistant's generation prompt at the end,
    as vLLM and SGLang build a chat request's prompt (``apply_chat_template`` with
    ``add_generation_prompt=True``, then encoded without adding special tokens again:
    the template writes them). A tokenizer without a template gets kvserve's ChatML
    one (``kvserve.model.init.CHAT_TEMPLATE``). Raises ValueError (one line) for no
    messages, a message that is not such a dict of strings, or messages the template
    refuses."""
    if not messages or not all(isinstance(m, Mapping) and isinstance(m.get("role"), str)
                               and isinstance(m.get("content"), str) for m in messages):
        raise ValueError('messages must be a non-empty list of {"role": str, "content": '
                         'str} objects')
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        from kvserve.model.init import CHAT_TEMPLATE

        template = CHAT_TEMPLATE
    try:
        rendered = tokenizer.apply_chat_template(list(messages), chat_template=template,
                                                 tokenize=False, add_generation_prompt=True)
    except Exception as err:  # jinja2's errors, or a template's raise_exception
        raise ValueError(f"messages do not fit the chat template: {err}") from None
    return list(tokenizer.encode(str(rendered), add_special_tokens=False))


__all__ = ["chat_prompt_ids"]
