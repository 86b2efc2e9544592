"""bench/peers.py (skillcache against llama.cpp's llama-server) without llama-server: its statistics, its
llama-server client against a canned stream, its idle wait, the prompt rendering, and the skillcache side of
arm a against the real service on loopback."""

import asyncio
import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import httpx
import pytest

from embedded_model import ROOT

sys.path.insert(0, str(ROOT / "bench"))

import peers_llama  # noqa: E402
import peers_run  # noqa: E402
import peers_stats  # noqa: E402
from peers_llama import llama_one  # noqa: E402
from peers_run import quiesce  # noqa: E402


def rec(ttft, e2e, n, error=None, **kw):
    return {"ttft_s": ttft, "e2e_s": e2e, "completion_tokens": n, "prompt_tokens": 100, "error": error, **kw}


def test_summary_ratios_and_verdicts():
    llama = [rec(1.0, 2.5, 16, prompt_computed=100), rec(3.0, 4.5, 16, prompt_computed=100)]
    sc = [rec(0.2, 1.7, 16, prompt_computed=10), rec(0.4, 1.9, 16, prompt_computed=30), rec(None, None, 0, "deadline")]
    a, b = peers_stats.summarize(llama), peers_stats.summarize(sc)
    assert (a["ok"], a["n"], a["errors"]) == (2, 2, {})
    assert (b["ok"], b["n"], b["errors"]) == (2, 3, {"deadline": 1})
    assert a["ttft_p50"] == pytest.approx(2000) and b["ttft_p50"] == pytest.approx(300)
    assert a["ttft_p90"] == pytest.approx(2800)
    assert a["decode_tok_s"] == pytest.approx(15 / 1.5) and b["prompt_computed_mean"] == pytest.approx(20)
    assert a["tok_s"] == pytest.approx(32 / 7.0)
    r = peers_stats.ratios(a, b)
    assert r["ttft_p50"] == pytest.approx(2000 / 300)
    assert peers_stats.verdict("ttft_p50", r["ttft_p50"]) == "6.67x ahead"  # skillcache's first token is sooner
    assert peers_stats.verdict("decode_tok_s", 2.0) == "2.00x behind"  # llama.cpp decodes twice as fast
    assert peers_stats.verdict("tok_s", 0.5) == "2.00x ahead"
    # streams at once: aggregate over the wall time, not the sum of their times
    assert peers_stats.summarize(llama, wall_s=4.0)["tok_s"] == pytest.approx(8.0)
    rows = [{"arm": "a", "llama.cpp": a, "skillcache": b, "ratio": r}]
    md = peers_stats.table(rows)
    assert "| a  first-time order | first token p50 (ms) | 2000 | 300 | 6.67 | 6.67x ahead |" in md
    assert "a       skillcache    2/3 deadline=1" in peers_stats.detail(rows)


def sse(*events) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)


def test_llama_client_times_the_first_token_and_checks_the_prompt(monkeypatch):
    final = {"content": "", "tokens": [], "stop": True, "tokens_predicted": 2, "tokens_evaluated": 5,
             "stop_type": "limit", "timings": {"prompt_n": 3, "cache_n": 2, "prompt_ms": 9.0, "predicted_ms": 4.0}}
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen.update(json.loads(request.content))
        body = sse({"content": "", "tokens": [], "stop": False}, {"content": "Hi", "tokens": [7], "stop": False},
                   {"content": " there", "tokens": [8], "stop": False}, final)
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    async def go(ids):
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://127.0.0.1:1") as c:
            return await llama_one(c, ids, 2, 0.0, cache_prompt=False)

    # the client's clock ticks one second each time it is read: a chunk is timed when it is read, the first token
    # is the first chunk that carries one (the second read, not the first, empty chunk), the end after the last
    ticks = iter(range(1, 100))
    monkeypatch.setattr(peers_llama, "time", SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    r = asyncio.run(go([1, 2, 3, 4, 5]))
    assert seen["prompt"] == [1, 2, 3, 4, 5] and seen["cache_prompt"] is False and seen["temperature"] == 0.0
    assert r["error"] is None and r["text"] == "Hi there" and r["tokens"] == [7, 8]
    assert (r["prompt_tokens"], r["prompt_n"], r["cache_n"], r["completion_tokens"]) == (5, 3, 2, 2)
    assert (r["ttft_s"], r["e2e_s"]) == (2.0, 5.0)  # 4 chunks read at 1..4 s, the end at 5 s
    # a server that saw another prompt than the ids sent: the request does not count
    assert asyncio.run(go([1, 2, 3]))["error"].startswith("prompt_mismatch")


class Servers:
    """quiesce's view of the machine in a test (its module's `time`, `asyncio.sleep` and `cpu_seconds`): a clock
    that moves only by the windows it waits, and servers whose CPU seconds are a function of that clock."""

    def __init__(self, load) -> None:
        self.now, self.waits, self.load = 0.0, [], load  # load(pid, now): that server's CPU seconds so far

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.now += seconds

    def cpu_seconds(self, pid: int) -> float:
        return self.load(pid, self.now)


def _quiesce(monkeypatch, load, pids, max_s, **kw) -> tuple[float, Servers]:
    servers = Servers(load)
    monkeypatch.setattr(peers_run, "time", SimpleNamespace(monotonic=servers.monotonic))
    monkeypatch.setattr(peers_run, "asyncio", SimpleNamespace(sleep=servers.sleep))
    monkeypatch.setattr(peers_run, "cpu_seconds", servers.cpu_seconds)
    return asyncio.run(quiesce(pids, max_s, **kw)), servers


def test_quiesce_waits_for_busy_servers_only(monkeypatch, capsys):
    idle = lambda pid, now: 1.5  # noqa: E731 - CPU seconds that do not grow
    busy = lambda pid, now: 1.5 + (now if pid == 2 else 0.0)  # noqa: E731 - pid 2 uses a whole core
    waited, servers = _quiesce(monkeypatch, idle, [1, 2], 5, window_s=0.25)
    assert waited == 0.25 and servers.waits == [0.25]  # one quiet window and it returns
    waited, servers = _quiesce(monkeypatch, busy, [1, 2], 1.0, window_s=0.25)
    assert waited == 1.0 and servers.waits == [0.25] * 4  # busy: windows until max_s, then it goes on anyway
    assert "still busy after 1 s" in capsys.readouterr().out
    # busy until 0.5 s (a calibration finishing): the window after it is quiet
    settling = lambda pid, now: min(now, 0.5)  # noqa: E731
    assert _quiesce(monkeypatch, settling, [1], 10, window_s=0.25)[0] == 0.75
    assert "warning" not in capsys.readouterr().out


def test_quiesce_sums_the_servers_against_busy_cores(monkeypatch, capsys):
    """Under busy_cores (0.05 of a core) over a window is quiet, and it is the servers together that count."""
    one = lambda pid, now: 0.04 * now  # noqa: E731 - each 0.04 of a core
    assert _quiesce(monkeypatch, one, [1], 10, window_s=1.0)[0] == pytest.approx(1.0)
    assert _quiesce(monkeypatch, one, [1, 2], 3, window_s=1.0)[0] == pytest.approx(3.0)  # together 0.08
    assert _quiesce(monkeypatch, one, [1, 2], 3, window_s=1.0, busy_cores=0.1)[0] == pytest.approx(1.0)
    capsys.readouterr()
    assert _quiesce(monkeypatch, one, [], 3)[0] == 0  # no servers of its own: nothing to wait for
    assert _quiesce(monkeypatch, one, [1], 0)[0] == 0 and "warning" not in capsys.readouterr().out


def test_cpu_seconds_reads_a_process_from_proc():
    """cpu_seconds on real processes: a spinning one's grows, a sleeping one's does not, a gone one's is 0. Only
    CPU time is compared (as much as the spinner gets, however loaded the machine), never how long it took."""
    if not os.path.exists("/proc/self/stat"):
        pytest.skip("reads Linux's /proc")
    idle = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(120)"],
                            stdout=subprocess.PIPE, text=True)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        assert idle.stdout.readline().strip() == "ready"  # started: from here on it only sleeps
        idle0, busy0 = peers_run.cpu_seconds(idle.pid), peers_run.cpu_seconds(busy.pid)
        deadline = time.monotonic() + 60  # only a hang guard
        while peers_run.cpu_seconds(busy.pid) - busy0 < 0.2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert peers_run.cpu_seconds(idle.pid) - idle0 <= 0.01  # at most one clock tick
    finally:
        for p in (idle, busy):
            p.kill()
            p.wait()
        idle.stdout.close()
    assert peers_run.cpu_seconds(busy.pid) == 0.0  # gone (reaped)


@pytest.mark.slow
def test_prompt_rendering_is_the_chat_template_with_the_skills_in_the_system_turn():
    from peers_work import SKILLS, Prompts

    from service.registry.skill import render
    from service.registry.skillfile import parse_skill_file

    p = Prompts(SKILLS)
    order = (SKILLS[2], SKILLS[0], SKILLS[1])
    texts = []
    for name in order:
        spec = parse_skill_file(ROOT / "skills" / f"{name}.md")
        texts.append(render(spec["text"], spec["fields"]))
    tok = p.builder.tok
    expected = tok.apply_chat_template([{"role": "system", "content": "\n\n".join(texts)},
                                        {"role": "user", "content": "Where is my parcel?"}],
                                       tokenize=False, add_generation_prompt=True)
    ids = p.ids(order, "Where is my parcel?")
    assert tok.decode(ids) == expected
    assert p.ids(order[::-1], "Where is my parcel?") != ids


@pytest.mark.slow
def test_skillcache_side_of_the_first_time_arm_against_the_real_service(tmp_path):
    out, png = tmp_path / "peers.json", tmp_path / "peers.png"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKILLCACHE_")}
    proc = subprocess.run(
        [sys.executable, "bench/peers.py", "--engines", "skillcache", "--quick", "--arms", "a", "--threads", "1",
         "--json", str(out), "--png", str(png), "--deadline-s", "180", "--settle-s", "60",
         # automatic heads off: arm a measures composition (two orders share refund-policy's exact head, which an
         # automatic head would serve; bench/auto.py measures that)
         "--server-env", "SKILLCACHE_SEAM_AUTO=false", "SKILLCACHE_SHADOW_SAMPLE_RATE=0",
         "SKILLCACHE_AUTO_REUSE=false"],
        cwd=ROOT, env=env, timeout=300, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    (row,) = data["rows"]
    sc, llama = row["skillcache"], row["llama.cpp"]
    assert row["arm"] == "a" and llama["n"] == 0
    # every prompt was built by the service from exactly the ids rendered here (else: prompt_mismatch errors)
    assert (sc["ok"], sc["n"], sc["errors"]) == (4, 4, {}), sc
    recs = row["records"]["skillcache"]
    assert all(r["prompt_tokens"] == r["n_ids"] for r in recs)
    assert len({tuple(r["order"]) for r in recs}) == 2 and all(r["prefix_tokens"] == 0 for r in recs)
    assert sc["prompt_computed_mean"] < 0.1 * sc["prompt_tokens_mean"]  # composed from the blocks
    assert sc["ttft_p50"] <= sc["e2e_p50"] and sc["completion_tokens_mean"] > 0
    assert set(data["skill_tokens"]) == {"refund-policy", "tool-specs", "style-guide"}
    assert png.stat().st_size > 10_000 and "first token p50" in proc.stdout
