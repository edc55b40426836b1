"""A client that never touches HTTP: the official Python NATS client submits a Job on
its tenant's `jobs.submit.<tenant>`, receives its streamed chunks and final result on
`results.<tenant>.<job>.<worker>.{chunk,final}`, accepting them only from the worker the
job's decision names (or from the dispatcher, `_dispatcher`), reads its stored decision,
and cancels its own job on `cancel.<tenant>.<job>`, as the demo tenant's client identity
of `./dev up` (`client-demo`; its permissions: submit and cancel for its tenant, read its
tenant's results and decisions, replies on its own inbox `_INBOX.client-demo`)."""

import asyncio
import json
import time
import uuid

import nats

from conftest import MODELS

PROTOCOL_VERSION = 3
DISPATCHER = "_dispatcher"


def _job(job_id: str, model: str, max_tokens: int) -> dict:
    return {
        "v": PROTOCOL_VERSION,
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


async def _connect(system, errors=None):
    user = system.env["METRONOME_CLIENT_NATS_USER"]

    async def on_error(e):
        if errors is not None:
            errors.append(str(e))

    return await nats.connect(
        system.nats_url,
        user=user,
        password=system.env["METRONOME_CLIENT_NATS_PASSWORD"],
        inbox_prefix=f"_INBOX.{user}".encode(),
        error_cb=on_error,
    )


class Results:
    """A job's results as a careful client reads them: the subject's fourth token is its
    publisher (the servers let a worker publish only under its own id); a worker's results
    count only once a decision assigned the job to that worker, and wait until then."""

    def __init__(self):
        self.worker = None
        self.waiting = []
        self.chunks = []
        self.ignored = []
        self.final = asyncio.get_running_loop().create_future()

    def _accept(self, publisher, kind, body):
        if publisher != DISPATCHER and publisher != self.worker:
            self.ignored.append(body)
        elif kind == "chunk":
            self.chunks.append(body)
        elif not self.final.done():
            self.final.set_result(body)

    async def on_result(self, msg):
        _, _tenant, _job, publisher, kind = msg.subject.split(".")
        body = json.loads(msg.data)
        if publisher != DISPATCHER and self.worker is None:
            self.waiting.append((publisher, kind, body))
        else:
            self._accept(publisher, kind, body)

    async def on_decision(self, msg):
        decision = json.loads(msg.data)
        if decision["outcome"] == "assigned" and decision.get("worker_id"):
            self.worker = decision["worker_id"]
            waiting, self.waiting = self.waiting, []
            for item in waiting:
                self._accept(*item)


async def _submit(nc, tenant, job, results):
    await nc.subscribe(f"results.{tenant}.{job['id']}.>", cb=results.on_result)
    await nc.subscribe(f"decisions.{tenant}.{job['id']}", cb=results.on_decision)
    await nc.flush()
    ack = await nc.jetstream().publish(
        f"jobs.submit.{tenant}", json.dumps(job).encode(), headers={"Nats-Msg-Id": job["id"]}
    )
    assert ack.stream == "JOBS"


async def _submit_and_collect(system, job: dict):
    tenant = system.env["METRONOME_CLIENT_TENANT"]
    nc = await _connect(system)
    try:
        results = Results()
        await _submit(nc, tenant, job, results)
        result = await asyncio.wait_for(results.final, timeout=60)
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
        return results, result, decision
    finally:
        await nc.close()


def test_direct_submission_streams_chunks_and_final_result(system):
    job = _job(str(uuid.uuid4()), MODELS[0], 12)
    results, final, decision = asyncio.run(_submit_and_collect(system, job))
    chunks = results.chunks

    assert final["error"] is None, final
    assert final["usage"]["completion_tokens"] == 12
    assert final["response"]["object"] == "chat.completion"
    assert final["response"]["choices"][0]["message"]["content"]
    assert [c["seq"] for c in chunks] == list(range(len(chunks)))
    assert len(chunks) >= 12
    assert all(c["worker_id"] == final["worker_id"] for c in chunks)
    assert results.ignored == []

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
    results, final, decision = asyncio.run(_submit_and_collect(system, job))
    assert results.chunks == []
    assert final["error"]["code"] == "unknown_model"
    assert decision["outcome"] == "rejected"
    assert decision["reason"]


def test_a_client_cancels_its_own_job_and_only_under_its_tenant(system):
    async def run():
        tenant = system.env["METRONOME_CLIENT_TENANT"]
        errors = []
        nc = await _connect(system, errors)
        try:
            job = _job(str(uuid.uuid4()), MODELS[0], 2000)
            results = Results()
            await _submit(nc, tenant, job, results)
            for _ in range(600):
                if results.chunks:
                    break
                await asyncio.sleep(0.05)
            assert results.chunks, "the job never started streaming"
            # Another tenant's subject (here the jobs of no tenant): refused by the server.
            await nc.publish(f"cancel._anon.{job['id']}", b"")
            await nc.flush()
            def refused():
                return any("permissions violation" in e.lower() and "cancel._anon" in e for e in errors)

            for _ in range(200):
                if refused():
                    break
                await asyncio.sleep(0.05)
            assert refused(), errors
            # Its own tenant's: the worker stops the job.
            await nc.publish(f"cancel.{tenant}.{job['id']}", b"")
            final = await asyncio.wait_for(results.final, timeout=60)
            assert final["error"]["code"] == "cancelled", final
        finally:
            await nc.close()

    asyncio.run(run())
