"""The request pump every continuously batching engine (vLLM, LMDeploy) is fed through."""
from __future__ import annotations

from collections import deque

from batch_llm.engines.base import GenRequest, GenResult, stream_requests


def test_window_bounds_in_flight_requests_and_rejections_become_error_rows():
    pulled = []
    inflight: deque[str] = deque()
    peak = 0

    def requests():
        for i in range(50):
            pulled.append(i)
            yield GenRequest(key=f"k{i}", prompt_token_ids=[1] * (i % 5))

    def submit(req):
        nonlocal peak
        if not req.prompt_token_ids:  # the engine refuses empty prompts
            return GenResult(req.key, error="engine rejected the request: empty prompt")
        inflight.append(req.key)
        peak = max(peak, len(inflight))
        return None

    def collect():  # an engine step: the two oldest requests finish
        return [GenResult(inflight.popleft(), text="ok", completion_tokens=1) for _ in range(min(2, len(inflight)))]

    out = []
    for res in stream_requests(requests(), window=8, submit=submit, collect=collect):
        out.append(res)
        assert len(pulled) - len(out) <= 8, "requests must be pulled lazily, a window at a time"
    assert peak == 8
    assert sorted(r.key for r in out) == sorted(f"k{i}" for i in range(50))
    errors = [r.key for r in out if r.error]
    assert errors == [f"k{i}" for i in range(0, 50, 5)]


def test_nothing_to_do_returns_at_once():
    assert list(stream_requests(iter(()), window=4, submit=lambda r: None, collect=lambda: [])) == []
