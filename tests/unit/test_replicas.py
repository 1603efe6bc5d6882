"""engine.replicas with a toy engine (no vLLM): started through the real start path, every request answered
exactly once by one replica, the work spread over all, a failure in one replica raised in the caller with the
others ended, an early close of the stream ending the threads, replicas started beside the generation joining
a running stream, and the config's refusals."""
from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator

import pytest
from batch_llm.config.capabilities import EngineCapabilities, register_capabilities
from batch_llm.engines.base import (
    Engine,
    EngineFailed,
    EngineInfo,
    EngineStartError,
    GenRequest,
    GenResult,
    stream_requests,
)
from batch_llm.engines.registry import register_engine, unregister_engine
from batch_llm.engines.replicas import ReplicaSet
from batch_llm.engines.start import start_engine
from helpers import demo_config

KIND = "toy-replicas"
WAIT = 20.0  # seconds a test waits for what should take well under one; past it, the test fails (no hang)


class Toy(Engine):
    """Answers with its replica number; streams a window ahead of what it finished, as vLLM's does, each step
    sleeping a little (the GPU's part), so the replicas' threads interleave."""

    kind = KIND
    started: list[Toy] = []
    failed: list[int] = []            # replica numbers whose start failed
    fail_after: dict[int, int] = {}   # replica number -> results it yields before raising EngineFailed
    start_fails: set[int] = set()     # replica numbers whose start fails (memory)
    window = 4                        # requests pulled ahead of those finished (vLLM's: 4 x max_num_seqs, >= 512)
    slow_first_submit: set[int] = set()  # replica numbers whose first request takes 0.2 s to take in
    start_delay: dict[int, float] = {}  # replica number -> seconds its start takes

    def start(self) -> EngineInfo:
        number = len(Toy.started) + 1 + len(Toy.failed)
        time.sleep(Toy.start_delay.get(number, 0.0))
        if number in Toy.start_fails:
            Toy.start_fails.discard(number)
            Toy.failed.append(number)
            raise EngineStartError(f"replica {number}: no memory left", memory=False)
        self.number, self.closed, self.streams_ended = number, False, 0
        Toy.started.append(self)
        return EngineInfo(kind=KIND, version="0", start_seconds=1.0,
                          settings={"gpu_memory_utilization": self.cfg.gpu_memory_utilization,
                                    "min_gpu_memory_utilization": self.cfg.memory_backoff.min_gpu_memory_utilization,
                                    "max_num_seqs": self.cfg.max_num_seqs})

    def generate(self, requests: Iterable[GenRequest]) -> Iterator[GenResult]:
        inflight: list[GenRequest] = []
        done = 0

        def submit(req: GenRequest) -> None:
            if self.number in Toy.slow_first_submit:
                Toy.slow_first_submit.discard(self.number)
                time.sleep(0.2)
            inflight.append(req)

        def collect() -> list[GenResult]:
            nonlocal done
            time.sleep(0.002)
            out = [GenResult(r.key, text=f"replica {self.number}") for r in inflight[:2]]
            del inflight[:2]
            done += len(out)
            if self.number in Toy.fail_after and done > Toy.fail_after[self.number]:
                raise EngineFailed(f"replica {self.number}'s engine core died")
            return out

        try:
            yield from stream_requests(requests, window=Toy.window, submit=submit, collect=collect)
        finally:
            self.streams_ended += 1

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def toy():
    register_capabilities(EngineCapabilities(KIND, __name__, replicas=True, engine_core_process=True))
    register_engine(Toy)
    Toy.started, Toy.fail_after, Toy.start_fails, Toy.window, Toy.slow_first_submit = [], {}, set(), 4, set()
    Toy.failed, Toy.start_delay = [], {}
    yield Toy
    unregister_engine(KIND)


def _start(tmp_path, replicas: int, said: list[str] | None = None, start: str = "before"
           ) -> tuple[ReplicaSet, EngineInfo]:
    """The replica set through the real start path; ``before`` (every replica up when it returns) unless a test is
    about starting beside the generation."""
    cfg = demo_config(tmp_path, engine__kind=KIND, engine__replicas=replicas, engine__gpu_memory_utilization=0.9,
                      engine__max_num_seqs=64, engine__replica_start=start)
    engine, info = start_engine("/nonexistent", cfg, (said if said is not None else []).append)
    assert isinstance(engine, ReplicaSet)
    return engine, info


def _requests(n: int) -> Iterator[GenRequest]:
    for i in range(n):  # lazy, as the shard's iterator renders rows: not thread-safe
        yield GenRequest(f"r{i}", [1, 2, i])


def _consume(stream: Iterator[GenResult]) -> tuple[list[GenResult], BaseException | None]:
    """Reads ``stream`` in a thread of its own, so a hang fails the test instead of stalling it."""
    got: list[GenResult] = []
    raised: list[BaseException] = []

    def read() -> None:
        try:
            got.extend(stream)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            raised.append(e)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(WAIT)
    assert not t.is_alive(), "the replica set's stream hung"
    return got, raised[0] if raised else None


def _replica_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("engine-replica-")]


def test_every_request_is_answered_once_by_one_replica_and_all_share_the_work(tmp_path, toy):
    engine, info = _start(tmp_path, 3)
    got, raised = _consume(engine.generate(_requests(300)))
    assert raised is None
    keys = Counter(r.key for r in got)
    assert set(keys) == {f"r{i}" for i in range(300)} and set(keys.values()) == {1}
    by_replica = Counter(r.text for r in got)
    assert set(by_replica) == {"replica 1", "replica 2", "replica 3"}
    assert sum(engine.pulled) == 300 and min(engine.pulled) >= 30, engine.pulled  # dealt, not all to the first
    assert [by_replica[f"replica {i + 1}"] for i in range(3)] == engine.pulled  # each answered what it pulled
    assert info.settings["replica_requests"] == engine.pulled  # the manifest says how the work was dealt
    # the shard's settings: the first's, each with a third of the memory and of the back-off's floor
    s = info.settings
    assert s["replicas"] == s["replicas_started"] == 3 and "replica_errors" not in s
    assert s["gpu_memory_utilization"] == 0.3 and s["min_gpu_memory_utilization"] == round(0.5 / 3, 4)
    assert [t.cfg.gpu_memory_utilization for t in toy.started] == [0.3] * 3
    # the others start once as the first ended (no back-off of their own: all pull the same window ahead)
    assert [t.cfg.memory_backoff.enabled for t in toy.started] == [True, False, False]
    assert info.start_seconds == 3.0 and len(info.attempts) == 3
    assert engine.max_model_len == toy.started[0].max_model_len
    got, raised = _consume(engine.generate(_requests(10)))  # a second stream (the shard's retry pass) works too
    assert raised is None and len(got) == 10
    assert not _replica_threads()
    engine.close()
    assert all(t.closed for t in toy.started)


def test_requests_ready_at_once_are_dealt_to_every_replica(tmp_path, toy):
    """A shard's rows tokenized while the engines started come out of the iterator at once; with a window larger
    than the shard, the first replica's thread would take them all before the second asked."""
    toy.window = 512
    engine, _ = _start(tmp_path, 2)
    got, raised = _consume(engine.generate(list(_requests(20))))
    assert raised is None and len(got) == 20
    assert min(engine.pulled) >= 5, engine.pulled
    engine.close()


def test_a_replica_slow_to_take_its_first_request_still_gets_its_share(tmp_path, toy):
    """vLLM's first request into an engine can take a tenth of a second; meanwhile the other replica, a window
    ahead, would pull the whole shard. Dealt by requests in flight, the slow one gets its share once it asks."""
    toy.window, toy.slow_first_submit = 512, {1}
    engine, _ = _start(tmp_path, 2)
    got, raised = _consume(engine.generate(list(_requests(40))))
    assert raised is None and len(got) == 40
    assert min(engine.pulled) >= 15, engine.pulled
    engine.close()


def test_a_failure_in_one_replica_is_raised_in_the_caller_and_the_others_end(tmp_path, toy):
    engine, _ = _start(tmp_path, 3)
    toy.fail_after[2] = 5
    got, raised = _consume(engine.generate(_requests(2000)))
    assert isinstance(raised, EngineFailed) and "replica 2's engine core died" in str(raised)
    assert len(got) < 2000 and len({r.key for r in got}) == len(got)
    assert not _replica_threads(), "every replica's thread ended"
    assert all(t.streams_ended == 1 for t in toy.started)
    engine.close()
    assert all(t.closed for t in toy.started)


def test_a_failing_request_iterator_is_raised_in_the_caller(tmp_path, toy):
    engine, _ = _start(tmp_path, 2)

    def requests() -> Iterator[GenRequest]:
        yield from _requests(50)
        raise OSError("the shard's input went away")

    got, raised = _consume(engine.generate(requests()))
    assert isinstance(raised, OSError) and "went away" in str(raised)
    assert not _replica_threads()
    engine.close()


def test_closing_the_stream_early_ends_the_threads(tmp_path, toy):
    engine, _ = _start(tmp_path, 2)
    stream = engine.generate(_requests(5000))
    first = [next(stream) for _ in range(10)]
    assert len({r.key for r in first}) == 10
    closer = threading.Thread(target=stream.close, daemon=True)
    closer.start()
    closer.join(WAIT)
    assert not closer.is_alive() and not _replica_threads()
    assert sum(engine.pulled) < 5000  # they stopped pulling
    assert all(t.streams_ended == 1 for t in toy.started)
    engine.close()


def test_a_replica_that_fails_to_start_is_left_out_and_said(tmp_path, toy):
    toy.start_fails.add(2)
    said: list[str] = []
    engine, info = _start(tmp_path, 3, said)
    assert len(engine.replicas) == 2
    assert info.settings["replicas"] == 3 and info.settings["replicas_started"] == 2
    assert "no memory left" in info.settings["replica_errors"][0]
    assert 2.0 <= info.start_seconds < 3.0 and len(info.attempts) == 2  # the two that started, and the failed try
    assert any("replica 2 of 3 failed to start; going on with 1" in s for s in said)
    got, raised = _consume(engine.generate(_requests(40)))
    assert raised is None and {r.key for r in got} == {f"r{i}" for i in range(40)}
    engine.close()


def test_replicas_are_refused_for_engines_without_them(tmp_path):
    with pytest.raises(ValueError, match=r"engine.replicas: .*engine.kind is 'transformers' \(vllm can\)"):
        demo_config(tmp_path, engine__kind="transformers", engine__replicas=2)
    with pytest.raises(ValueError, match=r"engine.replicas: 2 .* engine.multiprocessing is false"):
        demo_config(tmp_path, engine__replicas=2, engine__multiprocessing=False)
    with pytest.raises(ValueError):
        demo_config(tmp_path, engine__replicas=9)
    assert demo_config(tmp_path, engine__replicas=2, engine__multiprocessing=True).engine.replicas == 2


def test_anything_but_a_failed_start_closes_the_started_replicas(tmp_path, toy):
    from batch_llm.engines.registry import make_engine
    from batch_llm.engines.replicas import start_replicas

    cfg = demo_config(tmp_path, engine__kind=KIND)
    first = make_engine("/nonexistent", cfg.engine, cfg.sampling)
    info = first.start()

    def start_one():
        if len(toy.started) == 2:  # the third: interrupted
            raise KeyboardInterrupt
        engine = make_engine("/nonexistent", cfg.engine, cfg.sampling)
        return engine, engine.start()

    with pytest.raises(KeyboardInterrupt):
        start_replicas(first, info, 3, start_one, print, beside=False)
    assert len(toy.started) == 2 and all(t.closed for t in toy.started)


def test_replicas_started_beside_join_a_running_stream_and_the_shard_waits_for_the_first_only(tmp_path, toy):
    """engine.replica_start: beside (the default): start_engine returns once the first is up; the second starts
    while the first generates and takes its share of the stream from when it joins; every request once."""
    toy.start_delay = {2: 0.3, 3: 0.3}
    said: list[str] = []
    t0 = time.perf_counter()
    engine, info = _start(tmp_path, 3, said, start="beside")
    assert time.perf_counter() - t0 < 0.25 and len(engine.replicas) == 1  # the first's start alone
    assert info.start_seconds == 1.0 and len(info.attempts) == 1
    got, raised = _consume(engine.generate(_requests(3000)))
    assert raised is None
    keys = Counter(r.key for r in got)
    assert set(keys) == {f"r{i}" for i in range(3000)} and set(keys.values()) == {1}
    assert len(engine.replicas) == 3 and min(engine.pulled) >= 100, engine.pulled  # both late ones served
    assert engine.pulled[0] > engine.pulled[1] > 0  # the first had a head start
    s = info.settings
    assert s["replicas"] == s["replicas_started"] == 3 and s["replica_start"] == "beside"
    assert s["replica_start_seconds"] == [1.0, 1.0] and s["replica_requests"] == engine.pulled
    assert any("replica 2 of 3 started in 1.0s beside the generation" in x for x in said)
    assert [t.cfg.memory_backoff.enabled for t in toy.started] == [True, False, False]
    assert not _replica_threads()
    engine.close()
    assert all(t.closed for t in toy.started)


def test_a_replica_failing_to_start_beside_is_left_out_and_the_next_still_starts(tmp_path, toy):
    toy.start_fails.add(2)
    said: list[str] = []
    engine, info = _start(tmp_path, 3, said, start="beside")
    assert engine.wait_started(WAIT)
    assert len(engine.replicas) == 2 and info.settings["replicas_started"] == 2
    assert "no memory left" in info.settings["replica_errors"][0]
    assert any("replica 2 of 3 failed to start; going on with 1" in x for x in said)
    got, raised = _consume(engine.generate(_requests(200)))
    assert raised is None and {r.key for r in got} == {f"r{i}" for i in range(200)}
    assert min(engine.pulled) > 0
    engine.close()


def test_closing_while_a_replica_starts_beside_closes_it_once_up_and_starts_no_other(tmp_path, toy):
    """A shard that ends before the later replicas are up: close waits for the one starting, closes it, and the
    next never starts."""
    toy.start_delay = {2: 0.3}
    engine, _ = _start(tmp_path, 3, start="beside")
    got, raised = _consume(engine.generate(_requests(10)))
    assert raised is None and len(got) == 10 and len(engine.replicas) == 1
    engine.close()
    assert [t.number for t in toy.started] == [1, 2] and all(t.closed for t in toy.started)
    assert len(engine.replicas) == 1  # the late one never joined
