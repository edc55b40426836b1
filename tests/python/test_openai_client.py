"""The official `openai` Python client against Metronome's gateway, streaming and not: chat,
completions, tools, logprobs, `n` choices, stop sequences, embeddings and models, all answered
by the simulated GPUs through the whole system."""

import json
import math

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


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"],
        },
    },
}


def test_tool_call_when_the_request_asks_for_one(client):
    resp = client.chat.completions.create(
        model=MODELS[0], messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=64,
        tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert isinstance(args["city"], str) and isinstance(args["days"], int)


def test_streamed_tool_call_fragments_join_into_the_call(client):
    stream = client.chat.completions.create(
        model=MODELS[0], messages=[{"role": "user", "content": "Weather?"}], max_tokens=64,
        tools=[WEATHER_TOOL], tool_choice="required", stream=True,
    )
    name, arguments, finish = None, "", None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for call in delta.tool_calls or []:
            name = call.function.name or name
            arguments += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert name == "get_weather"
    assert set(json.loads(arguments)) == {"city", "days"}
    assert finish == "tool_calls"


def test_chat_logprobs_in_a_response_that_was_not_streamed(client):
    resp = client.chat.completions.create(
        model=MODELS[1], messages=[{"role": "user", "content": "Hello"}], max_tokens=6,
        logprobs=True, top_logprobs=3,
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == 6
    assert "".join(t.token for t in content) == resp.choices[0].message.content
    for t in content:
        assert t.logprob <= 0
        assert len(t.top_logprobs) == 3
        assert t.top_logprobs[0].token == t.token
        assert bytes(t.bytes) == t.token.encode()


def test_completion_logprobs_in_the_legacy_shape(client):
    resp = client.completions.create(model=MODELS[0], prompt="Once upon a time", max_tokens=5, logprobs=2)
    lp = resp.choices[0].logprobs
    assert "".join(lp.tokens) == resp.choices[0].text
    assert len(lp.token_logprobs) == 5
    assert all(len(top) == 2 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0


def test_n_choices_streamed_and_not(client):
    resp = client.chat.completions.create(
        model=MODELS[0], messages=[{"role": "user", "content": "Hello"}], max_tokens=4, n=3,
    )
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    assert len({c.message.content for c in resp.choices}) == 3
    assert resp.usage.completion_tokens == 12
    texts = {}
    for chunk in client.chat.completions.create(
        model=MODELS[0], messages=[{"role": "user", "content": "Hello"}], max_tokens=4, n=3, stream=True,
    ):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert texts == {c.index: c.message.content for c in resp.choices}


def test_stop_sequences_end_the_text_before_them(client):
    full = client.completions.create(model=MODELS[1], prompt="Tell me a story", max_tokens=30).choices[0].text
    word = full.split()[5]
    resp = client.completions.create(model=MODELS[1], prompt="Tell me a story", max_tokens=30, stop=["\n\n", word])
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == full[: full.index(word)]
    assert word not in choice.text
    assert resp.usage.completion_tokens < 30


def test_embeddings(client):
    resp = client.embeddings.create(model=MODELS[0], input=["the first text", "a second one"])
    assert [d.index for d in resp.data] == [0, 1]
    first, second = (d.embedding for d in resp.data)
    assert len(first) == len(second) > 0
    assert abs(math.sqrt(sum(x * x for x in first)) - 1) < 1e-3
    assert first != second
    assert resp.usage.prompt_tokens > 0
    again = client.embeddings.create(model=MODELS[0], input="the first text", encoding_format="float")
    assert again.data[0].embedding == pytest.approx(first, abs=1e-6)
