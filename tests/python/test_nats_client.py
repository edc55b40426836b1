"""A client that never touches HTTP: the official Python NATS client submits a Job on
its tenant's `jobs.submit.<tenant>`, receives its streamed chunks and final result on
`results.<tenant>.<job>.>`, and reads its stored decision, as the demo tenant's client
identity of `./dev up` (`client-demo`; its permissions: submit for its tenant, read its
tenant's results and decisions, replies on its own inbox `_INBOX.client-demo`)."""

import asyncio
import json
import time
import uuid

import nats

from conftest import MODELS


def _job(job_id: str, model: str, max_tokens: int) -> dict:
    return {
        "v": 2,
        "id": job_id,
        "model": model,
        "endpoint": "chat",
        "request": {
            "model": model,
            "messages": [{"role": "user", "content": "Say something about scheduling."}],
            "max_tokens": max_tokens,
        },
        "prompt_tokens": 8,
        "max_tokens": max_tokens,
        "submitted_ms": int(time.time() * 1000),
        "deadline_ms": int(time.time() * 1000) + 30_000,
    }


async def _submit_and_collect(system, job: dict):
    user = system.env["METRONOME_CLIENT_NATS_USER"]
    tenant = system.env["METRONOME_CLIENT_TENANT"]
    nc = await nats.connect(
        system.nats_url,
        user=user,
        password=system.env["METRONOME_CLIENT_NATS_PASSWORD"],
        inbox_prefix=f"_INBOX.{user}".encode(),
    )
    try:
        js = nc.jetstream()
        chunks, final = [], asyncio.get_running_loop().create_future()

        async def on_result(msg):
            body = json.loads(msg.data)
            if msg.subject.endswith(".chunk"):
                chunks.append(body)
            elif not final.done():
                final.set_result(body)

        await nc.subscribe(f"results.{tenant}.{job['id']}.>", cb=on_result)
        await nc.flush()
        ack = await js.publish(
            f"jobs.submit.{tenant}", json.dumps(job).encode(), headers={"Nats-Msg-Id": job["id"]}
        )
        assert ack.stream == "JOBS"
        result = await asyncio.wait_for(final, timeout=60)
        decision = None
        # A direct get naming the subject in the request subject: what a client identity
        # may do (the body-addressed reads would reach other tenants' records).
        for _ in range(100):
            msg = await nc.request(
                f"$JS.API.DIRECT.GET.DECISIONS.decisions.{tenant}.{job['id']}", b"", timeout=2
            )
            if msg.data and not (msg.headers or {}).get("Status"):
                decision = json.loads(msg.data)
                break
            await asyncio.sleep(0.05)
        return chunks, result, decision
    finally:
        await nc.close()


def test_direct_submission_streams_chunks_and_final_result(system):
    job = _job(str(uuid.uuid4()), MODELS[0], 12)
    chunks, final, decision = asyncio.run(_submit_and_collect(system, job))

    assert final["error"] is None, final
    assert final["usage"]["completion_tokens"] == 12
    assert final["response"]["object"] == "chat.completion"
    assert final["response"]["choices"][0]["message"]["content"]
    assert [c["seq"] for c in chunks] == list(range(len(chunks)))
    assert len(chunks) >= 12
    assert all(c["worker_id"] == final["worker_id"] for c in chunks)

    assert decision is not None, "no decision recorded"
    assert decision["outcome"] == "assigned"
    assert decision["worker_id"] == final["worker_id"]
    assert decision["candidates"], decision
    # The compact record (version 3): term names and weights once, each candidate's terms
    # as arrays in that order.
    assert decision["v"] == 3, decision
    assert len(decision["scoring"]["terms"]) == 7
    assert len(decision["scoring"]["weights"]) == 7
    for candidate in decision["candidates"]:
        assert len(candidate["raw"]) == 7
        assert len(candidate["normalised"]) == 7


def test_direct_submission_of_unknown_model_is_rejected_with_reason(system):
    job = _job(str(uuid.uuid4()), "no-such-model", 4)
    chunks, final, decision = asyncio.run(_submit_and_collect(system, job))
    assert chunks == []
    assert final["error"]["code"] == "unknown_model"
    assert decision["outcome"] == "rejected"
    assert decision["reason"]
