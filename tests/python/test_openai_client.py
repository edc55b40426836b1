"""The official `openai` Python client against Metronome's gateway, streaming and not."""

import openai
import pytest

from conftest import MODELS


@pytest.fixture()
def client(system):
    return openai.OpenAI(base_url=system.gateway_url + "/v1", api_key="not-needed", max_retries=0)


def test_models_lists_every_served_model(client):
    ids = {m.id for m in client.models.list().data}
    assert set(MODELS) <= ids


def test_chat_completion(client):
    raw = client.chat.completions.with_raw_response.create(
        model=MODELS[0], messages=[{"role": "user", "content": "Hello"}], max_tokens=10
    )
    resp = raw.parse()
    assert raw.headers["x-metronome-job-id"]
    assert raw.headers["x-metronome-worker"]
    assert resp.choices[0].message.content
    assert resp.usage.completion_tokens == 10


def test_chat_completion_streaming_with_usage(client):
    stream = client.chat.completions.create(
        model=MODELS[1], messages=[{"role": "user", "content": "Hello"}], max_tokens=9,
        stream=True, stream_options={"include_usage": True},
    )
    text, usage = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage:
            usage = chunk.usage
    assert text
    assert usage is not None and usage.completion_tokens == 9


def test_completion_and_streaming_completion(client):
    resp = client.completions.create(model=MODELS[0], prompt="Once upon a time", max_tokens=7)
    assert resp.choices[0].text
    assert resp.usage.completion_tokens == 7
    pieces = [c.choices[0].text for c in client.completions.create(
        model=MODELS[0], prompt="Once upon a time", max_tokens=5, stream=True) if c.choices]
    assert "".join(pieces)


def test_unknown_model_is_an_openai_not_found_error(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert err.value.status_code == 404
