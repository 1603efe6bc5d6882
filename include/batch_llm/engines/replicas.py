"""``engine.replicas``: several engines of one shard side by side on its GPU(s), seen by the shard as one.

For a small model one vLLM engine can leave the GPU idle: its engine-core process spends about as long per step on
CPU work (scheduling, preparing inputs, processing outputs) as the GPU spends on the step. Two engine cores on one
GPU, each with half the memory, overlap one's CPU work with the other's GPU work.

    requests (the shard's lazy iterator) ─> Dealer: one next() at a time, in the order replicas ask
        ├─> replica 1's generate (its own thread) ─┐
        └─> replica 2's generate (its own thread) ─┴─> one queue ─> the caller's thread, in finishing order

Each replica pulls a window ahead of what it finished (``base.stream_requests``), so the replica that asks next
is the one with room: the one with the fewest in flight. Every request is pulled by exactly one replica.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator

from batch_llm.engines.base import Engine, EngineInfo, EngineStartError, GenRequest, GenResult
from batch_llm.rows.params import Sampling

# Results waiting for the caller, all replicas together: bounds memory when the caller (commits, cache writes) is
# slower than the engines; a full queue holds the replica threads, as a slow caller holds one engine's generator.
QUEUE_RESULTS = 1024
# How long the caller waits for the replica threads to end once generation stops early (an error, the caller
# closing the generator): a thread ends after its engine's current step; close() ends a stuck one's engine.
JOIN_SECONDS = 30.0
# How long the first requests wait for every replica's thread to ask (Dealer): threads start in milliseconds.
START_GRACE = 2.0


def start_replicas(first: Engine, info: EngineInfo, n: int, start_one: Callable[[], tuple[Engine, EngineInfo]],
                   say: Callable[[str], None]) -> tuple[ReplicaSet, EngineInfo]:
    """Replicas 2..``n`` started one after another beside the started ``first`` (each vLLM engine sizes its KV
    cache from the memory it finds free, so two must not profile at once). A replica that fails to start is
    left out: the shard goes on with those that started, and ``settings`` say so (``replicas_started``,
    ``replica_errors``). Anything but a failed start (an interrupt) closes every started one and is raised."""
    engines, errors = [first], []
    settings = dict(info.settings)
    try:
        for i in range(2, n + 1):
            try:
                engine, more = start_one()
            except EngineStartError as e:
                errors.append(f"replica {i}: {str(e)[-300:]}")
                say(f"engine replica {i} of {n} failed to start; going on with {len(engines)}: {e}")
                continue
            engines.append(engine)
            info.start_seconds += more.start_seconds
            info.attempts = info.attempts + more.attempts
            say(f"engine replica {i} of {n} started in {more.start_seconds:.1f}s")
    except BaseException:
        for engine in engines:
            engine.close()
        raise
    settings.update(replicas=n, replicas_started=len(engines))
    if errors:
        settings["replica_errors"] = errors
    info.settings = settings
    return ReplicaSet(engines), info


class Dealer:
    """The caller's requests, one ``next()`` at a time (the iterator renders and tokenizes rows lazily: it is
    not thread-safe), served in the order the replicas ask (a ticket each, not a plain lock, which would let the
    replica that just pulled pull again before one that waited). Nothing is served until every replica has asked
    once (or ``START_GRACE`` passed): rows already tokenized while the engines started come out faster than a
    thread starts, and the first replica would take a whole window of them. ``stop`` ends every replica's
    stream."""

    def __init__(self, requests: Iterable[GenRequest], stop: threading.Event, replicas: int):
        self._it = iter(requests)
        self._stop = stop
        self._turn = threading.Condition()
        self._next_ticket = 0
        self._serving = 0
        self._exhausted = False
        self._replicas = replicas
        self._gate = time.monotonic() + START_GRACE

    def _may_serve(self, ticket: int) -> bool:
        if ticket != self._serving:
            return False
        return (self._next_ticket >= self._replicas or self._stop.is_set() or time.monotonic() >= self._gate)

    def pull(self) -> GenRequest | None:
        with self._turn:
            ticket = self._next_ticket
            self._next_ticket += 1
            self._turn.notify_all()
            while not self._may_serve(ticket):
                self._turn.wait(0.05)
        try:
            if self._exhausted or self._stop.is_set():
                return None
            req = next(self._it, None)
            self._exhausted = req is None
            return req
        except BaseException:  # the caller's iterator failed: raised in the replica that pulled; none pulls again
            self._exhausted = True
            raise
        finally:
            with self._turn:
                self._serving += 1
                self._turn.notify_all()

    def feed(self, counter: list[int], index: int) -> Iterator[GenRequest]:
        """One replica's view: the requests it pulls (``counter[index]`` counts them)."""
        while (req := self.pull()) is not None:
            counter[index] += 1
            yield req


class ReplicaSet(Engine):
    """Started engines of one kind and config serving one stream of requests (``generate``), closed together.
    Built by ``start_replicas``, never started itself."""

    def __init__(self, replicas: list[Engine]):
        first = replicas[0]
        super().__init__(first.model_dir, first.cfg, first.sampling, trust_remote_code=first.trust_remote_code,
                         lora_dir=first.lora_dir)
        self.kind = first.kind
        self.replicas = replicas
        self.pulled = [0] * len(replicas)  # requests each replica took, over every generate() (tests, logs)

    def start(self) -> EngineInfo:
        raise RuntimeError("a ReplicaSet is made of started engines (start_replicas)")

    def generate(self, requests: Iterable[GenRequest]) -> Iterator[GenResult]:
        stop = threading.Event()
        dealer = Dealer(requests, stop, len(self.replicas))
        results: queue.Queue = queue.Queue()  # results, and each thread's error and end (these never wait)
        room = threading.Semaphore(QUEUE_RESULTS)  # results only: the caller frees a place as it takes one

        def work(i: int, engine: Engine) -> None:
            stream = engine.generate(dealer.feed(self.pulled, i))
            try:
                for res in stream:
                    while not room.acquire(timeout=0.1):
                        if stop.is_set():
                            return
                    if stop.is_set():  # the caller stopped: what is still in flight is not wanted
                        return
                    results.put(("result", res))
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                stop.set()  # the others stop pulling and end; the caller raises this one
                results.put(("error", e))
            finally:
                stream.close()  # the engine's own cleanup (vLLM's engine-death watch) runs in this thread
                results.put(("done", i))

        threads = [threading.Thread(target=work, args=(i, engine), name=f"engine-replica-{i + 1}", daemon=True)
                   for i, engine in enumerate(self.replicas)]
        for t in threads:
            t.start()
        live = len(threads)
        try:
            while live:
                kind, item = results.get()
                if kind == "result":
                    room.release()
                    yield item
                elif kind == "done":
                    live -= 1
                else:
                    raise item
        finally:
            stop.set()
            for t in threads:
                t.join(JOIN_SECONDS)

    def close(self) -> None:
        for engine in self.replicas:
            engine.close()

    @property
    def max_model_len(self) -> int | None:
        return self.replicas[0].max_model_len

    def sampling_for(self, req: GenRequest) -> Sampling:
        return self.replicas[0].sampling_for(req)
