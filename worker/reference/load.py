"""``specctl load``: drive a reference worker's ``POST /v1/generate``.

Closed loop (``rate = 0``): ``concurrency`` clients, each sends its next
request when the previous one returns. Open loop (``rate > 0``): Poisson
arrivals at ``rate`` per second, at most ``concurrency`` in flight (arrivals
beyond that wait). Prompts are drawn at random from a prompt set; each
request carries the prompt's domain as its telemetry tag.
"""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field

from worker.reference.prompts import load_prompts

__all__ = ["LoadResult", "LoadStats", "generate_request", "run_load", "run_phase"]


@dataclass
class LoadResult:
    prompt_id: str
    domain: str
    ok: bool
    generated_tokens: int = 0
    accepted_tokens: int = 0
    steps: int = 0
    latency_s: float = 0.0
    ttft_s: float | None = None
    error: str = ""
    t_end: float = 0.0


@dataclass
class LoadStats:
    results: list[LoadResult] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, r: LoadResult) -> None:
        with self.lock:
            self.results.append(r)

    def summary(self, since: float = 0.0, until: float | None = None) -> dict:
        with self.lock:
            rs = [r for r in self.results if r.t_end >= since and (until is None or r.t_end <= until)]
        ok = [r for r in rs if r.ok]
        lat = sorted(r.latency_s for r in ok)
        span = ((until or time.time()) - since) if since else None
        tokens = sum(r.generated_tokens for r in ok)
        steps = sum(r.steps for r in ok)
        return {
            "requests": len(rs),
            "errors": len(rs) - len(ok),
            "tokens": tokens,
            "tokens_per_s": round(tokens / span, 2) if span else None,
            "mean_latency_s": round(sum(lat) / len(lat), 3) if lat else None,
            "p50_latency_s": round(lat[len(lat) // 2], 3) if lat else None,
            "p95_latency_s": round(lat[min(len(lat) - 1, int(0.95 * len(lat)))], 3) if lat else None,
            "tokens_per_step": round(tokens / steps, 3) if steps else None,
        }


def generate_request(worker: str, body: dict, timeout: float = 600.0) -> dict:
    req = urllib.request.Request(f"http://{worker}/v1/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def _one(worker: str, prompt, max_new_tokens: int, stats: LoadStats) -> None:
    t0 = time.perf_counter()
    try:
        out = generate_request(worker, {"prompt": prompt.text, "max_new_tokens": max_new_tokens,
                                        "domain": prompt.domain})
        stats.add(LoadResult(prompt.id, prompt.domain, True, out["generated_tokens"], out["accepted_tokens"],
                             out["steps"], time.perf_counter() - t0, out.get("ttft_s"), t_end=time.time()))
    except Exception as err:  # noqa: BLE001 - every failure is a data point
        stats.add(LoadResult(prompt.id, prompt.domain, False, latency_s=time.perf_counter() - t0,
                             error=f"{type(err).__name__}: {err}", t_end=time.time()))


def run_phase(worker: str, prompts, concurrency: int, duration_s: float, rate: float = 0.0,
              max_new_tokens: int = 64, stats: LoadStats | None = None, rng: random.Random | None = None,
              stop: threading.Event | None = None, requests: int = 0) -> LoadStats:
    """One load phase; returns when its time (or request count) is up and its requests are done."""
    stats = stats or LoadStats()
    rng = rng or random.Random(0)
    stop = stop or threading.Event()
    deadline = time.monotonic() + duration_s
    sent = [0]
    lock = threading.Lock()

    def take() -> bool:
        with lock:
            if stop.is_set() or time.monotonic() >= deadline or (requests and sent[0] >= requests):
                return False
            sent[0] += 1
            return True

    if rate <= 0:  # closed loop
        def client() -> None:
            while take():
                _one(worker, rng.choice(prompts), max_new_tokens, stats)

        threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return stats

    slots = threading.Semaphore(concurrency)
    threads = []
    while take():
        slots.acquire()

        def run(p=rng.choice(prompts)) -> None:
            try:
                _one(worker, p, max_new_tokens, stats)
            finally:
                slots.release()

        t = threading.Thread(target=run, daemon=True)
        t.start()
        threads.append(t)
        time.sleep(min(rng.expovariate(rate), max(0.0, deadline - time.monotonic())))
    for t in threads:
        t.join()
    return stats


def run_load(worker: str, rate: float = 0.0, concurrency: int = 1, prompts: str = "chat", duration_s: float = 60.0,
             requests: int = 0, max_new_tokens: int = 64, seed: int = 0, out: str = "") -> int:
    items = load_prompts(prompts)
    stats = LoadStats()
    start = time.time()
    mode = f"open loop {rate}/s" if rate > 0 else "closed loop"
    print(f"load: {worker}, {mode}, concurrency {concurrency}, prompts {prompts} ({len(items)}), "
          f"{'%d requests' % requests if requests else '%.0f s' % duration_s}", flush=True)
    done = threading.Event()

    def report() -> None:
        while not done.wait(5.0):
            s = stats.summary(since=start)
            print(f"  {time.time() - start:6.1f}s  requests {s['requests']:4d}  errors {s['errors']}  "
                  f"tokens/s {s['tokens_per_s'] or 0:7.2f}  tokens/step {s['tokens_per_step'] or 0:.2f}", flush=True)

    threading.Thread(target=report, daemon=True).start()
    run_phase(worker, items, concurrency, duration_s if not requests else 1e9, rate, max_new_tokens, stats,
              random.Random(seed), requests=requests)
    done.set()
    summary = stats.summary(since=start)
    print("load summary: " + json.dumps(summary), flush=True)
    if out:
        with open(out, "w") as f:
            json.dump({"summary": summary, "results": [asdict(r) for r in stats.results]}, f, indent=1)
    errors = [r.error for r in stats.results if not r.ok]
    if errors:
        print(f"first error: {errors[0]}", flush=True)
    return 0 if not errors else 1
