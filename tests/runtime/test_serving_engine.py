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
from service.runtime.serving import EngineConfig, ServingEngine
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


async def _engine(rt, **kw) -> ServingEngine:
    eng = ServingEngine(EngineConfig(**kw))
    await eng.run(lambda c: eng.bind(rt))
    return eng


async def _collect(job):
    return [e async for e in job.stream()]


def _submit(eng, rt, ids, p, chunk=None):
    return eng.submit_sequence(rt.prefill_steps(_plan(ids), [], mode="full", chunk=chunk), p, len(ids))


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


async def test_kv_budget_holds_requests_back_and_refuses_what_never_fits(rt):
    bpt = rt.kv_bytes_per_token()
    eng = await _engine(rt, max_running=8, kv_budget_bytes=bpt * 600)
    try:
        with pytest.raises(LimitExceeded, match="KV budget"):
            _submit(eng, rt, random_ids(300, seed=1), GenParams(max_tokens=100))  # 400 tokens, twice while joining
        jobs = [_submit(eng, rt, random_ids(100, seed=i), GenParams(max_tokens=150)) for i in range(3)]
        seen = []

        async def watch():
            while not all(j.cancel_event.is_set() for j in jobs):
                seen.append(len(eng.sched.running) + sum(w.is_sequence for w in eng.sched.active))
                await asyncio.sleep(0.002)

        watcher = asyncio.create_task(watch())
        outs = await asyncio.gather(*(_collect(j) for j in jobs))
        await watcher
        assert all(isinstance(o[-1], Done) and len(o[-1].token_ids) == 150 for o in outs)
        assert max(seen) == 1  # 2 rows of 250 tokens padded to 256 (+ a prefill of 100) pass 600: one at a time
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
        blocker = eng.submit(lambda c: gate.wait(10))
        while eng.n_waiting:
            await asyncio.sleep(0.01)
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


async def test_a_request_that_hangs_up_frees_its_row_within_a_step(rt):
    eng = await _engine(rt, max_running=4)
    try:
        keep = _submit(eng, rt, random_ids(6, seed=1), GenParams(max_tokens=60))
        gone = _submit(eng, rt, random_ids(6, seed=2), GenParams(max_tokens=1000))
        s_keep, s_gone = keep.stream(), gone.stream()
        await anext(s_keep)
        await anext(s_gone)
        while len(eng.sched.running) < 2:
            await asyncio.sleep(0.001)
        await s_gone.aclose()  # the client went away
        for _ in range(3):  # the next step reaps it
            await anext(s_keep)
        assert len(eng.sched.running) <= 1
        rest = [e async for e in s_keep]
        assert isinstance(rest[-1], Done) and rest[-1].finish_reason == "length"
    finally:
        eng.stop()


async def test_background_work_gets_its_share_under_load_and_all_when_idle(rt):
    """Under continuous live load, background steps get about `background_share` of the busy time; with no live
    work they run back to back."""
    eng = await _engine(rt, max_running=4, background_share=0.25)

    def bg_steps(n):
        for _ in range(n):
            rt.forward(random_ids(64, seed=5), 0, new_cache(rt.model.config))
            yield 64
        return "done"

    try:
        live = _submit(eng, rt, random_ids(20, seed=1), GenParams(max_tokens=4000))
        stream = live.stream()
        await anext(stream)
        bg = eng.submit_steps(bg_steps(100_000), background=True)
        await asyncio.sleep(3)
        share = metrics.BACKGROUND_SHARE._value.get()
        assert 0.15 < share < 0.35, share
        await stream.aclose()
        bg.cancel_event.set()
        busy = metrics.ENGINE_BUSY.labels("background")
        busy0, t0 = busy._value.get(), time.monotonic()
        assert await eng.run_steps(bg_steps(200), background=True) == "done"
        wall = time.monotonic() - t0 - eng.config.background_idle_s  # it waits that long after the last live step
        assert busy._value.get() - busy0 >= 0.8 * wall, (busy._value.get() - busy0, wall)  # idle: back to back
    finally:
        eng.stop()


async def test_an_idle_engine_waits_before_background_work_and_a_new_request_goes_first(rt):
    """Background work queued while a request runs starts only `background_idle_s` after the last live step; a
    request sent in that moment (a client's next request right after a response) runs first, not behind it."""
    eng = await _engine(rt, max_running=4, background_share=0.0, background_idle_s=0.4)
    order = []

    def bg_steps():
        order.append(("background", time.monotonic()))
        yield 1
        return "done"

    try:
        first = _submit(eng, rt, random_ids(12, seed=1), GenParams(max_tokens=3))
        stream = first.stream()
        await anext(stream)
        bg = eng.submit_steps(bg_steps(), background=True)  # share 0: it cannot run while the request is live
        async for _ in stream:
            pass
        t_done = time.monotonic()
        await asyncio.sleep(0.05)
        second = await _collect(_submit(eng, rt, random_ids(9, seed=2), GenParams(max_tokens=2)))
        order.append(("second", time.monotonic()))
        assert isinstance(second[-1], Done)
        assert await bg.result() == "done"
        assert [name for name, _ in order] == ["second", "background"]
        assert order[1][1] - t_done >= 0.35  # idle for background_idle_s after the second request's last step
    finally:
        eng.stop()


async def test_under_load_background_steps_leave_a_new_request_and_the_moment_after_one_ends_alone(rt):
    """With another stream decoding (never idle), background work due by its share still does not step while a
    request waits or prefills, nor within `background_idle_s` after one finished (its client's next request comes
    right then); it steps again after that. bench/background.py measured what such steps cost live p90 TTFT."""
    eng = await _engine(rt, max_running=4, background_share=0.5, background_idle_s=0.6)
    starts: list[float] = []

    def bg_steps():
        while True:
            starts.append(time.monotonic())
            time.sleep(0.02)  # a background chunk: the share is busy time, so it must take some
            yield 1

    try:
        long = _submit(eng, rt, random_ids(20, seed=1), GenParams(max_tokens=100_000))
        stream = long.stream()
        await anext(stream)
        bg = eng.submit_steps(bg_steps(), background=True)
        await asyncio.sleep(2.0)  # the share settles near 0.5, far above the 0.25 floor of steps that are not quiet
        n_before = len(starts)
        assert n_before > 10
        t_sub = time.monotonic()
        short, t_first = [], None
        async for ev in _submit(eng, rt, random_ids(9, seed=2), GenParams(max_tokens=3)).stream():
            t_first = t_first or time.monotonic()  # its prefill is done: from here it decodes beside the long one
            short.append(ev)
        t_end = time.monotonic()
        assert isinstance(short[-1], Done)
        await asyncio.sleep(1.2)
        # while it waits and prefills, none (a step already running when it came may end just after: 0.01 s); while it
        # decodes, steps may run by their share; after it ends none for 0.6 s (t_end is when this loop saw the end, a
        # little after the engine did: 0.3 s of slack)
        waiting = [t for t in starts if t_sub + 0.01 < t < t_first]
        after = [t for t in starts if t_end < t < t_end + 0.3]
        assert waiting == [] and after == [], (t_first - t_sub, t_end - t_sub, [t - t_sub for t in waiting + after])
        assert any(t > t_end + 0.6 for t in starts)  # quiet again: background steps resume
        await stream.aclose()
        bg.cancel_event.set()
    finally:
        eng.stop()


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
        await asyncio.sleep(0.3)  # background slices run between decode steps
        step, done = eng.batch.step, threading.Event()

        def step_submitting(tokens):  # on the engine thread: the request arrives during this forward
            out = step(tokens)
            eng.batch.step = step
            loop.call_soon_threadsafe(submit_short)
            loop.call_soon_threadsafe(done.set)  # after submit_short: the request is queued once this is set
            done.wait(5)
            events.append("arrived")
            return out

        eng.batch.step = step_submitting
        await asyncio.wait_for(submitted.wait(), 5)
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
    from service.runtime.engine import PrefillResult, run_steps

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
    try:
        eng.submit(lambda c: time.sleep(0.3))  # the three arrive while the engine is busy: they join together
        got = await asyncio.gather(*(_collect(eng.submit_sequence(steps(t), p, 300 + len(t))) for t, p in cases))
    finally:
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
    eng = ServingEngine(EngineConfig(torch_threads=wanted))
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
    from service.runtime.engine import PrefillResult
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
    try:
        eng.submit(lambda c: time.sleep(0.3))  # they arrive while the engine is busy: they finish composing together
        got = await asyncio.gather(*(_collect(eng.submit_sequence(steps(t), p, 200 + len(t))) for t, p in cases))
        again = await _collect(eng.submit_sequence(steps(cases[0][0]), cases[0][1], 205))  # alone: its own cache
    finally:
        eng.stop()
    assert together == [4]
    assert got == solo and again == solo[0]


async def test_a_ready_tail_does_not_wait_for_another_requests_prefill(rt, monkeypatch):
    """A composition whose tail is ready waits for at most one forward of the next request's prefill (seams, text),
    not for the whole pass: compositions that run forwards keep their first tokens in arrival order."""
    from service.runtime.engine import PrefillResult
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
    try:
        eng.submit(lambda c: time.sleep(0.3))  # both arrive while the engine is busy: one pass composes both
        jobs = [eng.submit_sequence(steps(0), GenParams(max_tokens=2), 35),
                eng.submit_sequence(steps(3), GenParams(max_tokens=2), 35)]
        await asyncio.gather(*(_collect(j) for j in jobs))
    finally:
        eng.stop()
    assert together == []
    assert order == ["forward", "tail", "forward", "forward", "tail"], order  # the first tail after one forward
