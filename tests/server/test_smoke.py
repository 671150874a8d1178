"""The server end to end through the official openai client (normal path)."""

from __future__ import annotations

import openai

from tests.server.conftest import MODEL_NAME


def test_openai_client_completion_chat_and_stream(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    done = client.completions.create(model=MODEL_NAME, prompt="Hello there", max_tokens=8,
                                     temperature=0)
    assert done.choices[0].finish_reason == "length"
    assert done.usage.completion_tokens == 8
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi " * 40}], max_tokens=6,
        temperature=0)
    assert chat.usage.completion_tokens == 6
    pieces = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi " * 40}], max_tokens=6,
        temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(pieces)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # same prompt again
    server.assert_clean()
