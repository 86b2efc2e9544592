"""The serving engine on a tiny model: batched requests get what they get alone; chunked prefill, admission,
the KV budget, cancellation and the background share."""

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from service import metrics
from service.errors import LimitExceeded, Overloaded
from service.kv.cache import new_cache
from service.runtime.decode import generate
from service.runtime.params import Delta, Done, GenParams
from service.runtime.prompt import PromptPlan, Segment
from service.runtime.serving import EngineConfig, ServingLoop
from tiny import random_ids, tiny_runtime


def _plan(ids):
    return PromptPlan([Segment("text", list(ids))])


def _alone(rt, ids, p):
    return [e for e in generate(rt, rt.prefill(_plan(ids), [], mode="full"), p)]


@pytest.fixture
def rt(monkeypatch):
    rt = tiny_runtime("llama")
    monkeypatch.setattr(rt, "eos_ids", set())  # random weights: generate to max_tokens
    return rt


async def _engine(rt, **kw) -> ServingLoop:
    eng = ServingLoop(EngineConfig(**kw))
    await eng.run(lambda c: eng.bind(rt))
    return eng


async def _collect(job):
    return [e async for e in job.stream()]


def _submit(eng, rt, ids, p, chunk=None):
    return eng.submit_sequence(rt.prefill_steps(_plan(ids), [], mode="full", chunk=chunk), p, len(ids))


async def _until(cond, what: str, timeout_s: float = 60.0) -> None:
    """Poll for a condition the engine thread makes true; the timeout only guards against a hang."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f} s"
        await asyncio.sleep(0.005)


class FakeClock:
    """The serving engine's clock in a test (its modules' `time`, see the `clock` fixture): it moves only when the
    test's work says it took time, so busy-time shares and idle windows are counted over the steps the engine
    runs, the same on an idle or a loaded machine."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def monotonic(self) -> float:
        return self.now

    perf_counter = monotonic

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def __getattr__(self, name):  # anything else (sleep, ...) is the real module's
        return getattr(time, name)


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    """Every clock the serving engine reads (step and busy times, the share's window, the idle wait, background
    slices) is this FakeClock for the engines the test creates."""
    from service.runtime.serving import background, loop, scheduler, starts, work

    fake = FakeClock()
    for module in (loop, scheduler, background, starts, work):
        monkeypatch.setattr(module, "time", fake)
    return fake


def _timed_decode(monkeypatch, eng, clock: FakeClock, seconds: float, log: list | None = None) -> None:
    """Each batched decode step of `eng` takes `seconds` on the fake clock; log: ("decode", rows, time after)."""
    step = eng.batch.step

    def timed(tokens):
        out = step(tokens)
        clock.advance(seconds)
        if log is not None:
            log.append(("decode", len(tokens), clock.now))
        return out

    monkeypatch.setattr(eng.batch, "step", timed)


async def test_concurrent_requests_get_their_solo_outputs(rt):
    """Greedy and seeded sampling, different lengths and max_tokens, stop strings: the events a request streams
    in a batch are the events it streams alone."""
    eng = await _engine(rt, max_running=8)
    try:
        cases = [(random_ids(n, seed=n), GenParams(max_tokens=m, temperature=t, seed=3, stop=stop))
                 for n, m, t, stop in [(5, 9, 0.0, []), (60, 14, 0.8, []), (23, 4, 0.0, []), (41, 12, 1.0, []),
                                       (9, 11, 0.0, [rt.tokenizer.decode(random_ids(1, seed=77))])]]
        solo = [_alone(rt, ids, p) for ids, p in cases]
        batched = await asyncio.gather(*(_collect(_submit(eng, rt, ids, p, chunk=16)) for ids, p in cases))
        for want, got in zip(solo, batched):
            assert got == want
        assert metrics.BATCH_SIZE.collect()[0].samples  # the batch ran
    finally:
        eng.stop()


async def test_chunked_prefill_interleaves_with_running_decodes(rt, monkeypatch):
    """A long prompt's prefill runs in chunks between decode steps: the running request keeps streaming."""
    eng = await _engine(rt, max_running=4, step_token_budget=32)
    order = []
    real_forward, real_step = rt.forward, eng.batch.step
    monkeypatch.setattr(rt, "forward", lambda ids, start, cache: order.append(("prefill", len(ids)))
                        or real_forward(ids, start, cache))
    monkeypatch.setattr(eng.batch, "step", lambda toks: order.append(("decode", len(toks))) or real_step(toks))
    try:
        short = _submit(eng, rt, random_ids(4, seed=1), GenParams(max_tokens=40))
        stream = short.stream()
        await anext(stream)  # decoding
        long = _submit(eng, rt, random_ids(200, seed=2), GenParams(max_tokens=2), chunk=32)

        async def rest():
            return [e async for e in stream]

        await asyncio.gather(_collect(long), rest())
    finally:
        eng.stop()
    chunks = [i for i, (kind, n) in enumerate(order) if kind == "prefill" and n == 32]
    assert len(chunks) >= 6  # 200 tokens in 32-token steps
    between = [kind for kind, _ in order[chunks[0]:chunks[-1]]]
    assert between.count("decode") >= len(chunks) - 1  # a decode step between every two chunks


async def test_serial_setting_runs_one_sequence_at_a_time(rt):
    eng = await _engine(rt, max_running=1)
    before = metrics.BATCH_SIZE.collect()[0]
    try:
        jobs = [_submit(eng, rt, random_ids(8, seed=i), GenParams(max_tokens=6)) for i in range(3)]
        await asyncio.gather(*(_collect(j) for j in jobs))
    finally:
        eng.stop()
    buckets = {s.labels["le"]: s.value for s in metrics.BATCH_SIZE.collect()[0].samples if s.name.endswith("bucket")}
    old = {s.labels["le"]: s.value for s in before.samples if s.name.endswith("bucket")}
    assert buckets["1.0"] - old.get("1.0", 0) == buckets["+Inf"] - old.get("+Inf", 0) > 0  # every step: batch of 1


async def test_kv_budget_holds_requests_back_and_refuses_what_never_fits(rt, monkeypatch):
    bpt = rt.kv_bytes_per_token()
    eng = await _engine(rt, max_running=8, kv_budget_bytes=bpt * 600)
    # sequences admitted (prefilling or decoding), seen on the engine thread at every prefill forward and decode step
    seen = []

    def admitted():
        seen.append(len(eng.sched.running) + sum(w.is_sequence for w in eng.sched.active))

    real_forward, real_step = rt.forward, eng.batch.step
    monkeypatch.setattr(rt, "forward", lambda ids, start, cache: admitted() or real_forward(ids, start, cache))
    monkeypatch.setattr(eng.batch, "step", lambda toks: admitted() or real_step(toks))
    try:
        with pytest.raises(LimitExceeded, match="KV budget"):
            _submit(eng, rt, random_ids(300, seed=1), GenParams(max_tokens=100))  # 400 tokens, twice while joining
        jobs = [_submit(eng, rt, random_ids(100, seed=i), GenParams(max_tokens=150)) for i in range(3)]
        outs = await asyncio.gather(*(_collect(j) for j in jobs))
        assert all(isinstance(o[-1], Done) and len(o[-1].token_ids) == 150 for o in outs)
        # 2 rows of 250 tokens padded to 256 (+ a prefill of 100) pass 600: one at a time, at every forward
        assert len(seen) > 3 * 140 and set(seen) == {1}, sorted(set(seen))
        assert eng.kv_bytes() == 256 * bpt  # the idle batch keeps its one row's buffers for the next request
        # kept buffers count: with them, a 300-token request's prefill would pass the budget, so the idle batch
        # gives them back before it starts (and the new row's buffers are all it holds after); a small one keeps them
        assert eng._fits(SimpleNamespace(need_tokens=20, n_prompt=10)) and eng.kv_bytes() == 256 * bpt
        assert eng._fits(SimpleNamespace(need_tokens=300, n_prompt=290)) and eng.kv_bytes() == 0
        big = _submit(eng, rt, random_ids(290, seed=9), GenParams(max_tokens=10))
        assert isinstance((await _collect(big))[-1], Done)
        assert eng.kv_bytes() == 512 * bpt
    finally:
        eng.stop()


async def test_a_full_queue_sheds_load(rt):
    eng = await _engine(rt, max_running=1, queue_size=2)
    import threading

    gate = threading.Event()
    try:
        blocker = eng.submit(lambda c: gate.wait(60))  # holds the engine until the queue is full
        await _until(lambda: not eng.n_waiting, "blocker taken off the queue")
        queued = [_submit(eng, rt, random_ids(4, seed=i), GenParams(max_tokens=2)) for i in range(2)]
        with pytest.raises(Overloaded):
            _submit(eng, rt, random_ids(4, seed=9), GenParams(max_tokens=2))
        gate.set()
        await blocker.result()
        for j in queued:
            assert isinstance((await _collect(j))[-1], Done)
    finally:
        gate.set()
        eng.stop()


async def test_a_request_that_hangs_up_frees_its_row_within_a_step(rt, monkeypatch):
    """The client hangs up while a decode step of both rows runs (the step waits for it): every step after that one
    runs without its row, and the request that stayed streams all its tokens."""
    eng = await _engine(rt, max_running=4)
    steps = []  # (rows, the client had hung up by the end of the step)
    both, hung_up = threading.Event(), threading.Event()
    real_step = eng.batch.step

    def step(toks):
        if len(toks) == 2 and not hung_up.is_set():
            both.set()
            hung_up.wait(60)
        steps.append((len(toks), gone.cancelled()))
        return real_step(toks)

    try:
        keep = _submit(eng, rt, random_ids(6, seed=1), GenParams(max_tokens=60))
        gone = _submit(eng, rt, random_ids(6, seed=2), GenParams(max_tokens=1000))
        monkeypatch.setattr(eng.batch, "step", step)
        client = asyncio.create_task(_collect(gone))  # reads its stream (its first text may need a decode step)
        await _until(both.is_set, "decode step of both rows")
        client.cancel()  # the client went away
        await asyncio.wait([client])
        assert gone.cancelled()
        hung_up.set()
        rest = await _collect(keep)
        assert isinstance(rest[-1], Done) and rest[-1].finish_reason == "length"
        assert len(rest[-1].token_ids) == 60
        saw = steps.index((2, True))  # the step it hung up in
        assert steps[saw + 1:] and all(rows == 1 for rows, _ in steps[saw + 1:]), steps[saw:]
        assert eng.sched.running == []
    finally:
        hung_up.set()
        eng.stop()


async def test_background_work_gets_its_share_under_load_and_all_when_idle(rt, clock, monkeypatch):
    """Under continuous live load, background steps get about `background_share` of the busy time; with no live
    work every engine step gives them a turn, back to back. On the fake clock a decode step and a background step
    each take 10 ms, so the share is counted over the steps the engine ran, not timed on this machine."""
    eng = await _engine(rt, max_running=4, background_share=0.25, background_idle_s=0.0)
    _timed_decode(monkeypatch, eng, clock, 0.01)
    steps, turns = [], []  # every engine step's (live, background) busy time; the background turns given
    account, advance = eng.sched.account, eng.bg.advance
    monkeypatch.setattr(eng.sched, "account", lambda live_s, bg_s: steps.append((live_s, bg_s))
                        or account(live_s, bg_s))
    monkeypatch.setattr(eng.bg, "advance", lambda *a: turns.append(len(steps)) or advance(*a))

    def bg_steps(n):
        for _ in range(n):
            clock.advance(0.01)
            yield 64
        return "done"

    def steady():
        """The steps since background work first gave way to its share (before: it catches up, one a step)."""
        seen = list(steps)
        first = next((i for i, (_, bg) in enumerate(seen) if bg > 0), None)
        held = None if first is None else next((i for i in range(first, len(seen)) if seen[i][1] == 0), None)
        return [] if held is None else seen[held:]

    try:
        live = _submit(eng, rt, random_ids(20, seed=1), GenParams(max_tokens=100_000))
        stream = live.stream()
        await anext(stream)
        bg = eng.submit_steps(bg_steps(10**9), background=True)
        # a steady window of 300 steps (or 3000 turns, enough to catch up with any lead the live stream had)
        await _until(lambda: len(steady()) >= 300 or len(turns) >= 3000, "300 steps of background work in its share")
        window = steady()[:300]
        assert len(window) == 300, f"background work never held back to its share in {len(turns)} turns"
        assert all(live_s > 0 for live_s, _ in window)  # under load: every one of them decoded
        share = sum(bg for _, bg in window) / sum(live_s + bg for live_s, bg in window)
        assert 0.2 < share < 0.3, share
        assert 0.2 < metrics.BACKGROUND_SHARE._value.get() < 0.3  # the decaying window the engine reports
        await stream.aclose()
        bg.cancel_event.set()
        await _until(lambda: not eng.busy, "the engine to go idle")  # both reaped
        n_steps, n_turns = len(steps), len(turns)
        assert await asyncio.wait_for(eng.run_steps(bg_steps(200), background=True), 60) == "done"
        idle_steps, idle_turns = steps[n_steps:], turns[n_turns:]
        assert all(live_s == 0 for live_s, _ in idle_steps)
        # idle: a background turn in every step from the first on, nothing between them (after the last, a step
        # that finds the work finished and takes it off the list)
        assert len(idle_turns) > 200 and idle_turns == list(range(n_steps, n_steps + len(idle_turns))), idle_turns
    finally:
        eng.stop()


async def test_an_idle_engine_waits_before_background_work_and_a_new_request_goes_first(rt, clock, monkeypatch):
    """Background work queued while a request runs starts only `background_idle_s` after the last live step; a
    request sent in that moment (a client's next request right after a response) runs first, not behind it. On the
    fake clock no time passes between the requests; the test then moves it past the idle wait in two stages."""
    eng = await _engine(rt, max_running=4, background_share=0.0, background_idle_s=0.4)
    _timed_decode(monkeypatch, eng, clock, 0.01)
    order = []
    looks = [0]  # times the idle engine asked whether work is due (it then reads the clock)
    has_work = eng.sched.has_work

    def counted():
        looks[0] += threading.current_thread() is eng.thread
        return has_work()

    monkeypatch.setattr(eng.sched, "has_work", counted)

    def bg_steps():
        order.append(("background", clock.now))
        yield 1
        return "done"

    try:
        first = _submit(eng, rt, random_ids(12, seed=1), GenParams(max_tokens=3))
        stream = first.stream()
        await anext(stream)
        bg = eng.submit_steps(bg_steps(), background=True)  # share 0: it cannot run while the request is live
        async for _ in stream:
            pass
        second = await _collect(_submit(eng, rt, random_ids(9, seed=2), GenParams(max_tokens=2)))
        assert isinstance(second[-1], Done)
        n = looks[0]  # its Done comes before its last step ends: wait for the engine to look for work after it
        await _until(lambda: looks[0] > n, "the engine to finish the second request's last step")
        t_last = clock.now  # nothing runs now, so the clock stands where the second request's last step ended
        order.append(("second", t_last))
        # the clock moves only here; after each move the engine is woken (resume_background takes its condition's
        # lock, so the wake-up lands while it waits) to look at it again, as the real clock would have it do
        clock.advance(0.39)  # not yet idle for 0.4 s
        n = looks[0]
        eng.resume_background()
        await _until(lambda: looks[0] >= n + 2, "the engine to look at the moved clock")  # twice: it waited between
        assert [name for name, _ in order] == ["second"]
        clock.advance(0.02)
        eng.resume_background()
        assert await asyncio.wait_for(bg.result(), 60) == "done"
        assert [name for name, _ in order] == ["second", "background"]
        assert order[1][1] - t_last >= 0.4  # idle for background_idle_s after the second request's last step
    finally:
        eng.stop()


async def test_background_work_starts_when_the_idle_wait_ends_between_two_clock_readings(rt, clock, monkeypatch):
    """The engine reads the clock once to decide whether background work is due and how long to wait: read twice,
    an idle wait that ends between the two readings leaves the work waiting for a wake-up that never comes. Here
    every reading by the engine's thread moves the fake clock on by a tick, and the idle wait ends exactly one tick
    after the engine's first look at the background work."""
    eng = await _engine(rt, max_running=4, background_share=0.0, background_idle_s=0.5)
    clock.now = 1024.0  # every time here is a sum of binary fractions: exact, so the wait ends exactly
    _timed_decode(monkeypatch, eng, clock, 0.25)
    tick = [0.0]

    def ticking() -> float:
        t = clock.now
        if threading.current_thread() is eng.thread:
            clock.now += tick[0]
        return t

    monkeypatch.setattr(clock, "monotonic", ticking)

    def bg_steps():
        yield 1
        return "done"

    try:
        await _collect(_submit(eng, rt, random_ids(12, seed=1), GenParams(max_tokens=2)))
        await _until(lambda: not eng.busy and not eng._in_step, "the request's last step to end")
        with eng._wake:  # the engine reads the clock only under this lock while it is idle: none of it moves yet
            tick[0] = 0.125
            clock.now = eng._t_live + 0.5 - tick[0]  # one tick before the idle wait ends
            bg = eng.submit_steps(bg_steps(), background=True)
        assert await asyncio.wait_for(bg.result(), 10) == "done"
    finally:
        eng.stop()


async def test_under_load_background_steps_leave_a_new_request_and_the_moment_after_one_ends_alone(
        rt, clock, monkeypatch):
    """With another stream decoding (never idle), background work due by its share still does not step while a
    request prefills, nor within `background_idle_s` after one finished (its client's next request comes right
    then); it steps again after that. bench/background.py measured what such steps cost live p90 TTFT. On the fake
    clock a decode step takes 10 ms and a background step 20 ms."""
    eng = await _engine(rt, max_running=4, background_share=0.5, background_idle_s=0.6, step_token_budget=16)
    log: list[tuple] = []  # on the engine thread, in order: ("decode", rows, t after), ("bg", t), ("prefill...", t)
    _timed_decode(monkeypatch, eng, clock, 0.01, log)

    def bg_steps():
        while True:
            log.append(("bg", clock.now))
            clock.advance(0.02)  # a background chunk: the share is busy time, so it must take some
            yield 1

    def share() -> float:  # of the busy time in the engine's decaying window
        busy = eng.sched.live_s + eng.sched.background_s
        return eng.sched.background_s / busy if busy else 0.0

    def short_steps(ids):  # 80 tokens, 16 a step: its prefill spans 5 steps
        log.append(("prefill-start", clock.now, share()))
        pre = yield from rt.prefill_steps(_plan(ids), [], mode="full", chunk=8)
        log.append(("prefill-end", clock.now))
        return pre

    def short_decodes() -> list[int]:
        """Indexes of the short request's decode steps (the long stream decodes alone before and after)."""
        return [i for i, e in enumerate(list(log)) if e[0] == "decode" and e[1] == 2]

    try:
        long = _submit(eng, rt, random_ids(20, seed=1), GenParams(max_tokens=100_000))
        stream = long.stream()
        await anext(stream)
        bg = eng.submit_steps(bg_steps(), background=True)
        # the share settles near 0.5, far above the 0.25 floor of steps that are not quiet, over enough busy time
        # (3 s on the clock) that 0.6 s of live steps alone leave it above that floor
        await _until(lambda: share() > 0.45 and eng.sched.live_s + eng.sched.background_s > 3.0,
                     "a background share above 0.45 over 3 s of busy time")
        ids = random_ids(80, seed=2)
        short = await _collect(eng.submit_sequence(short_steps(ids), GenParams(max_tokens=3), len(ids)))
        assert isinstance(short[-1], Done) and len(short[-1].token_ids) == 3
        await _until(lambda: any(e[0] == "bg" for e in list(log)[short_decodes()[-1] + 1:]), "background steps again")
        await stream.aclose()
        bg.cancel_event.set()
    finally:
        eng.stop()
    names = [e[0] for e in log]
    start, end = names.index("prefill-start"), names.index("prefill-end")
    assert log[start][2] > 0.25  # by its share a background step was due even in a step that is not quiet
    assert [e for e in log[start:end] if e[0] == "decode"]  # the long stream decoded meanwhile (never idle)
    assert "bg" not in names[start:end], log[start:end]  # none while it prefills
    two = short_decodes()
    assert len(two) == 2 and two[0] > end  # its second and third tokens, beside the long stream
    last = two[-1]
    t_end = log[last][2]  # when it ended (its last decode step)
    after = [e[1] for e in log[last + 1:] if e[0] == "bg"]
    assert after and min(after) - t_end >= 0.6 - 1e-9, (min(after) - t_end)  # none within 0.6 s, then again


async def test_a_request_that_arrives_during_a_decode_step_prefills_before_any_background_slice(rt):
    """A request submitted while a decode forward runs is in the queue when that step's background turn comes: it
    is admitted and prefilled next, even when the share would allow a background slice in a step that is not
    quiet (a slice gives way only to arrivals after it starts, so it would hold this one for its whole length)."""
    eng = await _engine(rt, max_running=4, background_share=1.0, background_idle_s=0.0)
    events: list[str] = []
    loop = asyncio.get_running_loop()
    submitted = asyncio.Event()
    jobs = []

    def bg_steps():
        while True:
            events.append("background")
            yield 1

    def short_steps(ids):
        events.append("prefill")
        return (yield from rt.prefill_steps(_plan(ids), [], mode="full"))

    def submit_short():
        ids = random_ids(9, seed=2)
        jobs.append(eng.submit_sequence(short_steps(ids), GenParams(max_tokens=2), len(ids)))
        submitted.set()

    try:
        long = _submit(eng, rt, random_ids(20, seed=1), GenParams(max_tokens=100_000))
        stream = long.stream()
        await anext(stream)
        bg = eng.submit_steps(bg_steps(), background=True)
        await _until(lambda: events.count("background") >= 10, "background slices between decode steps")
        step, done = eng.batch.step, threading.Event()

        def step_submitting(tokens):  # on the engine thread: the request arrives during this forward
            out = step(tokens)
            eng.batch.step = step
            loop.call_soon_threadsafe(submit_short)
            loop.call_soon_threadsafe(done.set)  # after submit_short: the request is queued once this is set
            assert done.wait(60)
            events.append("arrived")
            return out

        eng.batch.step = step_submitting
        await asyncio.wait_for(submitted.wait(), 60)
        short = await _collect(jobs[0])
        assert isinstance(short[-1], Done)
        after = events[events.index("arrived") + 1:]
        assert after and after[0] == "prefill", after[:5]
        await stream.aclose()
        bg.cancel_event.set()
    finally:
        eng.stop()


def test_background_keeps_half_its_share_when_no_step_is_quiet():
    """A step that is not quiet runs background work only below half its share: busy live work cannot starve it."""
    from service.runtime.serving.scheduler import Scheduler
    from service.runtime.serving.work import Job, StepsWork

    sched = Scheduler(max_running=4, step_token_budget=64, queue_size=4, background_share=0.2)
    loop = asyncio.new_event_loop()
    try:
        w = StepsWork(Job(loop), iter(()), background=True)
        assert sched.add(w)
        sched.live_s, sched.background_s = 0.85, 0.15  # share 0.15: due, above the floor of 0.1
        assert sched.next_background(live_pending=True, quiet=True) is w
        assert sched.next_background(live_pending=True, quiet=False) is None
        sched.live_s, sched.background_s = 0.95, 0.05  # below the floor
        assert sched.next_background(live_pending=True, quiet=False) is w
        sched.live_s, sched.background_s = 0.7, 0.3  # its share is spent
        assert sched.next_background(live_pending=True, quiet=True) is None
        assert sched.next_background(live_pending=False, quiet=False) is w  # nothing live: always
    finally:
        loop.close()


async def test_failure_in_a_prefill_reaches_only_its_request(rt):
    eng = await _engine(rt, max_running=4)

    def broken():
        yield 1
        raise RuntimeError("boom")

    try:
        ok = _submit(eng, rt, random_ids(6, seed=1), GenParams(max_tokens=5))
        bad = eng.submit_sequence(broken(), GenParams(max_tokens=5), 4)
        with pytest.raises(RuntimeError, match="boom"):
            await _collect(bad)
        out = await _collect(ok)
        assert isinstance(out[-1], Done) and all(isinstance(e, Delta) for e in out[:-1])
        assert eng.thread.is_alive()
    finally:
        eng.stop()


async def test_a_short_prompt_is_not_held_behind_a_long_prefill(rt):
    """The step budget is shared round robin: a composed request's few text tokens run in the next step, while a
    long prefill admitted before it goes on in chunks."""
    eng = await _engine(rt, step_token_budget=64)
    order = []

    async def watch(name, job):
        await _collect(job)
        order.append(name)

    try:
        long = _submit(eng, rt, random_ids(1500, seed=3), GenParams(max_tokens=1), chunk=32)
        short = _submit(eng, rt, random_ids(5, seed=4), GenParams(max_tokens=1))
        await asyncio.gather(watch("long", long), watch("short", short))
    finally:
        eng.stop()
    assert order == ["short", "long"]


async def test_requests_arriving_together_prefill_oldest_first(rt, monkeypatch):
    """Prompts that fit one step's budget are prefilled one after another in arrival order, not interleaved chunk
    by chunk: the oldest gets its first token when its own prefill ends, not when all of theirs have."""
    eng = await _engine(rt, step_token_budget=512)
    caches = []
    real_forward = rt.forward
    monkeypatch.setattr(rt, "forward", lambda ids, start, cache: caches.append(id(cache))
                        or real_forward(ids, start, cache))
    try:
        jobs = [_submit(eng, rt, random_ids(40, seed=10 + i), GenParams(max_tokens=1), chunk=8) for i in range(4)]
        await asyncio.gather(*(_collect(j) for j in jobs))
    finally:
        eng.stop()
    runs = [c for i, c in enumerate(caches) if i == 0 or caches[i - 1] != c]
    assert len(caches) >= 20 and len(runs) == 4, runs  # 5 chunks each, one request's chunks after another's


async def test_requests_on_the_same_prefix_share_its_reads_and_get_their_solo_outputs(rt, monkeypatch):
    """Three requests whose caches start with the same copied 300-token prefix (as composed requests on the same
    skill do): the engine reports rows reading shared chunks, and each request streams what it streams alone."""
    from service.kv.cache import append_kv
    from service.runtime.steps import PrefillResult, run_steps

    prefix = new_cache(rt.model.config)
    rt.forward(random_ids(300, seed=9), 0, prefix)

    def steps(tail):
        cache = new_cache(rt.model.config)
        append_kv(cache, [lay.keys for lay in prefix.layers], [lay.values for lay in prefix.layers])
        logits = rt.forward(tail, 300, cache)
        yield len(tail)
        return PrefillResult(cache, logits, 300 + len(tail), 300, len(tail))

    def alone(tail, p):
        return list(generate(rt, run_steps(steps(tail)), p))

    seen = []
    monkeypatch.setattr(metrics.SHARED_ROWS, "set", seen.append)
    cases = [(random_ids(n, seed=n), GenParams(max_tokens=m)) for n, m in [(4, 9), (11, 6), (7, 12)]]
    solo = [alone(t, p) for t, p in cases]
    eng = await _engine(rt, max_running=8)
    gate = threading.Event()
    try:
        eng.submit(lambda c: gate.wait(60))  # the three arrive while the engine is held: they join together
        jobs = [eng.submit_sequence(steps(t), p, 300 + len(t)) for t, p in cases]
        gate.set()
        got = await asyncio.gather(*(_collect(j) for j in jobs))
    finally:
        gate.set()
        eng.stop()
    assert got == solo
    assert max(seen) == 2  # rows 1 and 2 read the prefix's first chunk from row 0


def test_idle_only_work_is_passed_over_while_live_work_is_pending():
    """A guess (a section seen once, service/compose/autoblocks.py) takes no share from live requests; once its
    condition turns false (seen again) it runs in the share like any background work."""
    from service.runtime.serving.scheduler import Scheduler
    from service.runtime.serving.work import Job, StepsWork

    sched = Scheduler(max_running=4, step_token_budget=64, queue_size=4, background_share=0.5)
    loop = asyncio.new_event_loop()
    try:
        guess = {"seen_once": True}
        w = StepsWork(Job(loop), iter(()), background=True, idle_only=lambda: guess["seen_once"])
        other = StepsWork(Job(loop), iter(()), background=True, priority=5.0)
        assert sched.add(w) and sched.add(other)
        assert sched.next_background(live_pending=True) is other  # the guess waits, the rest runs
        assert sched.next_background(live_pending=True, current=w) is None  # parked mid-forward: waits too
        assert sched.next_background(live_pending=False) is w  # idle: it runs first (lower priority)
        guess["seen_once"] = False
        assert sched.next_background(live_pending=True) is w
    finally:
        loop.close()


def test_background_work_runs_lowest_priority_first():
    """Calibrations before refinements (by expected benefit), shadow checks last."""
    from service.runtime.serving.scheduler import Scheduler
    from service.runtime.serving.work import Job, StepsWork

    sched = Scheduler(max_running=4, step_token_budget=64, queue_size=4, background_share=0.5)
    loop = asyncio.new_event_loop()
    try:
        works = {name: StepsWork(Job(loop), iter(()), background=True, priority=p)
                 for name, p in [("shadow", 1.0), ("refine-small", -10.0), ("calibration", -1e18),
                                 ("refine-big", -500.0)]}
        for w in works.values():
            assert sched.add(w)
        order = []
        while (w := sched.next_background(live_pending=False)) is not None:
            order.append(next(name for name, x in works.items() if x is w))
            w.finished = True
    finally:
        loop.close()
    assert order == ["calibration", "refine-big", "refine-small", "shadow"]


def test_a_background_priority_is_read_when_work_is_picked():
    """A callable priority can change while its work waits: the scheduler picks afresh each time."""
    from service.runtime.serving.scheduler import Scheduler
    from service.runtime.serving.work import Job, StepsWork

    sched = Scheduler(max_running=4, step_token_budget=64, queue_size=4, background_share=0.5)
    loop = asyncio.new_event_loop()
    try:
        seen = {"repeated": 1}
        one_off = StepsWork(Job(loop), iter(()), background=True, priority=-50.0)
        repeated = StepsWork(Job(loop), iter(()), background=True, priority=lambda: -20.0 * seen["repeated"])
        assert sched.add(one_off) and sched.add(repeated)
        assert sched.next_background(live_pending=False) is one_off
        seen["repeated"] = 3  # composed twice more while queued: 60 tokens' worth now
        assert sched.next_background(live_pending=False) is repeated
    finally:
        loop.close()


async def test_the_engine_thread_runs_the_torch_threads_it_is_given():
    """SKILLCACHE_TORCH_THREADS is the model thread's count (service/runtime/threads.py)."""
    import torch

    before = torch.get_num_threads()
    wanted = 1 if before != 1 else 2  # differs from this thread's count, so the assert can fail
    eng = ServingLoop(EngineConfig(torch_threads=wanted))
    try:
        assert await eng.run(lambda c: torch.get_num_threads()) == wanted
    finally:
        eng.stop()
        torch.set_num_threads(before)  # claim() moved torch's process-wide default


def test_work_that_finished_is_not_served_any_more():
    """A request's own work finishes (its job has the result) before the step that ran it takes it off the lists;
    `serving` (asked by that request right after: the refiner's one-off rule) must not count it."""
    from service.runtime.serving.scheduler import Scheduler
    from service.runtime.serving.work import Job, StepsWork

    sched = Scheduler(max_running=4, step_token_budget=64, queue_size=4, background_share=0.5)
    loop = asyncio.new_event_loop()
    try:
        own, other = StepsWork(Job(loop), iter(())), StepsWork(Job(loop), iter(()))
        assert sched.add(own)
        own.finished = True  # as the engine thread leaves it until the step ends
        assert sched.has_live() and not sched.has_unfinished_live()
        assert sched.add(other)
        assert sched.has_unfinished_live()
    finally:
        loop.close()


def test_token_stream_text_equals_a_full_decode_however_long(rt):
    """The stream re-decodes a window, not the whole reply per token: its deltas still add up to the full text."""
    from service.runtime.decode import TokenStream

    text = "Refunds are allowed within 30 days of delivery — café, naïve, 😀 — when the item is unused. " * 12
    ids = rt.tokenizer.encode(text, add_special_tokens=False)
    stream = TokenStream(rt.tokenizer, set(), GenParams(max_tokens=len(ids)))
    deltas = [d.text for t in ids for d in stream.push(t)]
    done = stream.finish()
    text = "".join(deltas + [d.text for d in done if isinstance(d, Delta)])
    assert text == done[-1].text == rt.tokenizer.decode(ids, skip_special_tokens=True)
    assert stream._offset > 200  # it settled most of the reply


async def test_tails_left_to_the_engine_run_together_and_each_request_gets_its_solo_output(rt, monkeypatch):
    """Compositions that leave their text tails to the engine (prefill_steps' defer_tail) and finish composing in
    the same step: their tails run as one forward over their batch rows, and each request streams what it streams
    with its tail run on its own cache (greedy; one of them ends at its first token and leaves at once)."""
    from service.kv.cache import append_kv
    from service.runtime.steps import PrefillResult
    from service.runtime.serving.runner import DecodeBatch

    prefix = new_cache(rt.model.config)
    rt.forward(random_ids(200, seed=21), 0, prefix)

    def composed(tail):
        cache = new_cache(rt.model.config)
        append_kv(cache, [lay.keys for lay in prefix.layers], [lay.values for lay in prefix.layers])
        return cache

    def steps(tail):
        yield 0
        return PrefillResult(composed(tail), None, 200 + len(tail), 200, len(tail), tail=tail, tail_start=200)

    def alone(tail, p):
        cache = composed(tail)
        pre = PrefillResult(cache, rt.forward(tail, 200, cache), 200 + len(tail), 200, len(tail))
        return list(generate(rt, pre, p))

    together = []
    real = DecodeBatch.prefill_tails
    monkeypatch.setattr(DecodeBatch, "prefill_tails", lambda self, tails: together.append(len(tails))
                        or real(self, tails))
    cases = [(random_ids(n, seed=30 + n), GenParams(max_tokens=m)) for n, m in [(5, 8), (17, 1), (9, 11), (2, 6)]]
    solo = [alone(t, p) for t, p in cases]
    eng = await _engine(rt, max_running=8)
    gate = threading.Event()
    try:
        eng.submit(lambda c: gate.wait(60))  # they arrive while the engine is held: they finish composing together
        jobs = [eng.submit_sequence(steps(t), p, 200 + len(t)) for t, p in cases]
        gate.set()
        got = await asyncio.gather(*(_collect(j) for j in jobs))
        again = await _collect(eng.submit_sequence(steps(cases[0][0]), cases[0][1], 205))  # alone: its own cache
    finally:
        gate.set()
        eng.stop()
    assert together == [4]
    assert got == solo and again == solo[0]


async def test_a_ready_tail_does_not_wait_for_another_requests_prefill(rt, monkeypatch):
    """A composition whose tail is ready waits for at most one forward of the next request's prefill (seams, text),
    not for the whole pass: compositions that run forwards keep their first tokens in arrival order."""
    from service.runtime.steps import PrefillResult
    from service.runtime.serving.runner import DecodeBatch

    order = []
    real_forward = rt.forward

    def forward(ids, start, cache):
        if start == 30 and len(ids) == 5:
            order.append("tail")
        return real_forward(ids, start, cache)

    monkeypatch.setattr(rt, "forward", forward)

    def steps(n_text):
        cache = new_cache(rt.model.config)
        real_forward(random_ids(30, seed=n_text), 0, cache)
        for _ in range(n_text):  # text or seams run before the tail: forwards of their own
            order.append("forward")
            yield 8
        return PrefillResult(cache, None, 35, 0, 35, tail=random_ids(5, seed=3), tail_start=30)

    together = []
    real_together = DecodeBatch.prefill_tails
    monkeypatch.setattr(DecodeBatch, "prefill_tails", lambda self, tails: together.append(len(tails))
                        or real_together(self, tails))
    eng = await _engine(rt, max_running=8)
    gate = threading.Event()
    try:
        eng.submit(lambda c: gate.wait(60))  # both arrive while the engine is held: one pass composes both
        jobs = [eng.submit_sequence(steps(0), GenParams(max_tokens=2), 35),
                eng.submit_sequence(steps(3), GenParams(max_tokens=2), 35)]
        gate.set()
        await asyncio.gather(*(_collect(j) for j in jobs))
    finally:
        gate.set()
        eng.stop()
    assert together == []
    assert order == ["forward", "tail", "forward", "forward", "tail"], order  # the first tail after one forward


def test_ignore_eos_runs_to_max_tokens_but_a_typed_reply_still_ends_at_eos(rt):
    """`ignore_eos` (vLLM's and llama.cpp's): end-of-sequence is a token like any other, the reply runs to max_tokens;
    under a json_schema the reply still ends where its JSON does."""
    from service.runtime.decode import TokenStream

    ids = rt.tokenizer.encode("One two three", add_special_tokens=False)
    eos = 7
    plain = TokenStream(rt.tokenizer, {eos}, GenParams(max_tokens=4))
    plain.push(ids[0]), plain.push(eos)
    assert plain.reason == "stop" and plain.ids == [ids[0]]
    ignoring = TokenStream(rt.tokenizer, {eos}, GenParams(max_tokens=4, ignore_eos=True))
    for t in (ids[0], eos, ids[1]):
        ignoring.push(t)
        assert ignoring.reason is None
    ignoring.push(ids[2])
    assert ignoring.reason == "length" and ignoring.ids == [ids[0], eos, ids[1], ids[2]]
    typed = TokenStream(rt.tokenizer, {eos}, GenParams(max_tokens=4, ignore_eos=True, json_schema='{"type": "object"}'))
    typed.push(eos)
    assert typed.reason == "stop"
