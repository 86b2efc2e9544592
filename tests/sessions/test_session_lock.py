"""A session runs one turn at a time: its lock is freed as soon as the turn's response ends, however it ends, and
concurrent requests for a session that is not in memory share one copy of it (and so its lock)."""

import asyncio
import gc
import json

import httpx
import pytest

from test_sessions import app  # noqa: F401  (the same app fixture: the policy skill registered)


async def _hang_up(app, path: str, body: dict, at: str, spec: str, engine) -> None:
    """One request straight through the ASGI app; the client hangs up while the server sends message `at`
    (`http.response.start`, or the first `http.response.body`). ASGI spec 2.4 servers make that send fail; older
    ones (uvicorn) drop writes after a disconnect and report it to `receive`, and Starlette cancels the response."""
    raw = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": spec}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "client": ("127.0.0.1", 1), "server": ("testserver", 80),
             "headers": [(b"host", b"testserver"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(raw)).encode())]}
    gone, read = asyncio.Event(), [False]

    async def receive():
        if not read[0]:
            read[0] = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        while engine.busy:  # a slow client: the whole (short) reply is queued before anything goes out
            await asyncio.sleep(0.01)
        if message["type"] == at and not gone.is_set():
            gone.set()
            if spec == "2.4":
                raise OSError("connection reset by peer")
            await asyncio.sleep(0.2)  # a slow write: the response is cancelled meanwhile

    try:
        await app(scope, receive, send)
    except Exception:  # noqa: BLE001 - ClientDisconnect (spec 2.4): what the server sees; not the point here
        pass


@pytest.mark.parametrize("spec", ["2.3", "2.4"])
@pytest.mark.parametrize("at", ["http.response.start", "http.response.body"])
def test_turn_lock_is_released_when_a_streaming_client_hangs_up(app, at, spec):
    """The reply is short, so every event is queued when the stream starts: nothing awaits in the turn's event
    generator, and only closing it (not the garbage collector, which may never come) frees the session."""
    mgr = app.app.state.skillcache.sessions
    sid = app.post("/v1/sessions", json={"skills": ["policy"]}).json()["id"]
    # the lock must not wait for the abandoned generators to be collected: keep them alive, as a reference
    # cycle (an exception's traceback) does until a collection runs
    held, real_turn = [], mgr.turn

    async def turn(*args):
        held.append(await real_turn(*args))
        return held[-1]

    mgr.turn = turn
    gc.disable()
    try:
        app.portal.call(_hang_up, app.app, f"/v1/sessions/{sid}/turns",
                        {"user": "Refund?", "max_tokens": 2, "stream": True}, at, spec, mgr.p.engine)
        assert held and not mgr.live[sid].lock.locked()
    finally:
        gc.enable()
    r = app.post(f"/v1/sessions/{sid}/turns", json={"user": "Again?", "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_streamed_turn_still_completes_and_frees_the_session(app):
    sid = app.post("/v1/sessions", json={"skills": ["policy"]}).json()["id"]
    r = app.post(f"/v1/sessions/{sid}/turns", json={"user": "Refund?", "max_tokens": 3, "stream": True})
    frames = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]" and json.loads(frames[-2])["type"] == "done"
    assert not app.app.state.skillcache.sessions.live[sid].lock.locked()
    assert app.get(f"/v1/sessions/{sid}").json()["turns"] == 1


def test_concurrent_turns_on_a_session_not_in_memory_run_one_at_a_time(app):
    """Evicted, restarted or held by another replica: both requests resume it at once. They must share one
    Session, so the second is `session_busy` as on a live session, and no turn is lost."""
    mgr = app.app.state.skillcache.sessions
    sid = app.post("/v1/sessions", json={"skills": ["policy"]}).json()["id"]
    assert app.post(f"/v1/sessions/{sid}/turns", json={"user": "Refund?", "max_tokens": 2}).status_code == 200
    app.portal.call(mgr.drain)
    mgr.live.pop(sid)  # evicted: only the saved copy is left
    real_load = mgr.saved.load

    async def slow_load(ns, sid):  # both requests arrive while the saved copy is being read
        await asyncio.sleep(0.1)
        return await real_load(ns, sid)

    mgr.saved.load = slow_load

    async def two_turns():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app.app), base_url="http://t") as h:
            return await asyncio.gather(*(h.post(f"/v1/sessions/{sid}/turns", json={"user": f"turn {i}",
                                                                                   "max_tokens": 2})
                                          for i in range(2)))

    rs = app.portal.call(two_turns)
    assert sorted(r.status_code for r in rs) == [200, 409]
    assert next(r for r in rs if r.status_code == 409).json()["error"]["type"] == "session_busy"
    assert app.get(f"/v1/sessions/{sid}").json()["turns"] == 2
    app.portal.call(mgr.drain)
    mgr.live.pop(sid)
    assert app.get(f"/v1/sessions/{sid}").json()["turns"] == 2  # the saved copy too
    assert not mgr._loading  # nothing left behind


def test_a_turn_closed_before_its_events_are_read_frees_the_session(app):
    """The response may be cancelled before its body starts: closing the turn's events then still frees it."""
    from service.runtime.params import GenParams

    mgr = app.app.state.skillcache.sessions
    sid = app.post("/v1/sessions", json={"skills": ["policy"]}).json()["id"]

    async def start_and_close():
        events = await mgr.turn("default", sid, "Refund?", {}, GenParams(max_tokens=2))
        assert mgr.live[sid].lock.locked()
        await events.aclose()
        return mgr.live[sid].lock.locked()

    assert app.portal.call(start_and_close) is False
    assert app.post(f"/v1/sessions/{sid}/turns", json={"user": "Again?", "max_tokens": 2}).status_code == 200


def test_event_stream_closes_its_events_when_the_body_never_started():
    from service.api.sse import sse_response

    closed = []

    class Events:  # what a session turn returns: closing it frees the session
        def __aiter__(self):
            return self

        async def __anext__(self):
            raise StopAsyncIteration

        async def aclose(self):
            closed.append(True)

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):  # the client is gone before the status line
        raise OSError("connection reset by peer")

    response = sse_response(Events(), lambda ev: [])
    with pytest.raises(Exception):  # noqa: B017 - ClientDisconnect; the point is what was closed
        asyncio.run(response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send))
    assert closed
