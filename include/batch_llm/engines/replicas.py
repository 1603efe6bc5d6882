"""``engine.replicas``: several engines of one shard side by side on its GPU(s), seen by the shard as one.

For a small model one vLLM engine can leave the GPU idle: its engine-core process spends about as long per step on
CPU work (scheduling, preparing inputs, processing outputs) as the GPU spends on the step. Two engine cores on one
GPU, each with half the memory, overlap one's CPU work with the other's GPU work.

    requests (the shard's lazy iterator) ─> Dealer: one next() at a time, to the replica with the fewest in flight
        ├─> replica 1's generate (its own thread) ─┐
        └─> replica 2's generate (its own thread) ─┴─> one queue ─> the caller's thread, in finishing order

Each replica pulls a window ahead of what it finished (``base.stream_requests``) and asks when it has room; of
those asking, the one with the fewest requests in flight gets the next. Every request is pulled by exactly one
replica.

By default (``engine.replica_start: beside``) the shard waits for the first replica only: the others start one after
another on a background thread while it generates, and each joins the stream (a thread of its own, a place in the
dealing) the moment it is up. A start takes about as long as the first's (~20 s on an H100, most of it the engine
core importing vLLM in its own process), which would otherwise come before every row.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator

from batch_llm.engines.base import Engine, EngineInfo, EngineStartError, GenRequest, GenResult
from batch_llm.rows.params import Sampling

# Results waiting for the caller, all replicas together: bounds memory when the caller (commits, cache writes) is
# slower than the engines; a full queue holds the replica threads, as a slow caller holds one engine's generator.
QUEUE_RESULTS = 1024
# How long the caller waits for the replica threads to end once generation stops early (an error, the caller
# closing the generator): a thread ends after its engine's current step; close() ends a stuck one's engine.
JOIN_SECONDS = 30.0
# Dealing (Dealer): how long the first requests wait for every replica's thread to ask (threads start in
# milliseconds); how many requests more than another a replica may have in flight, and how long it then waits for
# the other to ask (an engine step on a GPU takes milliseconds to tens of them) before it takes one anyway.
START_GRACE = 2.0
LEAD = 8
LEAD_WAIT = 0.25


# How long closing a replica set waits for a replica still starting in the background (its engine is then closed).
START_JOIN_SECONDS = 600.0


def start_replicas(first: Engine, info: EngineInfo, n: int, start_one: Callable[[], tuple[Engine, EngineInfo]],
                   say: Callable[[str], None], *, beside: bool = True) -> tuple[ReplicaSet, EngineInfo]:
    """Replicas 2..``n`` started one after another beside the started ``first`` (each vLLM engine sizes its KV
    cache from the memory it finds free, so two must not profile at once): ``beside``, on a background thread while
    the first generates (each joins the set once up; ``info`` is the first's start alone), else here, before this
    returns (their starts added to ``info``). A replica that fails to start is left out: the shard goes on with
    those that started, and ``settings`` say so (``replicas_started``, ``replica_errors``). Here, anything but a
    failed start (an interrupt) closes every started one and is raised."""
    settings = dict(info.settings)
    settings.update(replicas=n, replicas_started=1, replica_start="beside" if beside else "before")
    info.settings = settings
    replica_set = ReplicaSet([first], settings)
    if beside:
        replica_set.start_later(range(2, n + 1), n, start_one, say)
        return replica_set, info
    try:
        for i in range(2, n + 1):
            t0 = time.perf_counter()
            try:
                engine, more = start_one()
            except EngineStartError as e:
                info.start_seconds += time.perf_counter() - t0  # the shard waited for it all the same
                replica_set.start_failed(i, n, e, say)
                continue
            replica_set.join(engine)
            info.start_seconds += more.start_seconds
            info.attempts = info.attempts + more.attempts
            say(f"engine replica {i} of {n} started in {more.start_seconds:.1f}s")
    except BaseException:
        replica_set.close()
        raise
    return replica_set, info


class Dealer:
    """The caller's requests dealt to the replicas, one ``next()`` at a time (the iterator renders and tokenizes
    rows lazily: it is not thread-safe). Of the replicas asking, the one with the fewest requests in flight (then
    the one that asked first) gets the next request, and a replica does not run more than ``LEAD`` ahead of one
    that is busy elsewhere (taking a request into its engine, or stepping it) for longer than ``LEAD_WAIT``:
    one engine's first request can take a tenth of a second to take in, and the other replica would meanwhile
    pull a window of rows (a whole small shard). Nothing is dealt until every replica asked once (or
    ``START_GRACE`` passed), for the same reason. ``stop`` ends every replica's stream."""

    def __init__(self, requests: Iterable[GenRequest], stop: threading.Event, pulled: list[int]):
        self._it = iter(requests)
        self._stop = stop
        self._cond = threading.Condition()
        self.pulled = pulled  # requests each replica took (the caller's counter, over several streams)
        self._inflight = [0] * len(pulled)
        self._live = set(range(len(pulled)))
        self._asked: set[int] = set()
        self._waiting: dict[int, int] = {}  # replica -> its ticket (the order they asked in)
        self._tickets = 0
        self._serving = False
        self._exhausted = False
        self._gate = time.monotonic() + START_GRACE

    def _dealt_to(self, i: int, since: float) -> bool:
        if self._serving:
            return False
        if self._exhausted or self._stop.is_set():
            return True
        now = time.monotonic()
        if not self._live <= self._asked and now < self._gate:
            return False
        if min(self._waiting, key=lambda j: (self._inflight[j], self._waiting[j])) != i:
            return False
        others = [self._inflight[j] for j in self._live if j != i]
        return not others or self._inflight[i] - min(others) < LEAD or now - since >= LEAD_WAIT

    def pull(self, i: int) -> GenRequest | None:
        with self._cond:
            self._waiting[i] = self._tickets
            self._tickets += 1
            self._asked.add(i)
            self._cond.notify_all()
            since = time.monotonic()
            while not self._dealt_to(i, since):
                self._cond.wait(0.01)
            del self._waiting[i]
            if self._exhausted or self._stop.is_set():
                self._cond.notify_all()
                return None
            self._serving = True
        try:
            req = next(self._it, None)
        except BaseException:  # the caller's iterator failed: raised in the replica that pulled; none pulls again
            req = None
            raise
        finally:
            with self._cond:
                self._serving = False
                if req is None:
                    self._exhausted = True
                else:
                    self._inflight[i] += 1
                    self.pulled[i] += 1
                self._cond.notify_all()
        return req

    def add(self, i: int) -> None:
        """Replica ``i`` joins the dealing (started while the others generate); ``pulled`` already has its place."""
        with self._cond:
            self._inflight.extend([0] * (i + 1 - len(self._inflight)))
            self._live.add(i)
            self._cond.notify_all()

    def finished(self, i: int) -> None:
        """Replica ``i`` yielded a result: one request fewer in flight there."""
        with self._cond:
            self._inflight[i] -= 1
            self._cond.notify_all()

    def retire(self, i: int) -> None:
        """Replica ``i``'s stream ended: the others no longer wait for it."""
        with self._cond:
            self._live.discard(i)
            self._cond.notify_all()

    def feed(self, i: int) -> Iterator[GenRequest]:
        """Replica ``i``'s view of the requests."""
        while (req := self.pull(i)) is not None:
            yield req


class ReplicaSet(Engine):
    """Started engines of one kind and config serving one stream of requests (``generate``), closed together.
    Built by ``start_replicas``, never started itself; replicas started later ``join`` it, a running ``generate``
    included. ``settings`` (the shard's engine settings) get ``replica_requests``: the requests each replica took
    so far, and ``replicas_started`` as replicas join."""

    def __init__(self, replicas: list[Engine], settings: dict | None = None):
        first = replicas[0]
        super().__init__(first.model_dir, first.cfg, first.sampling, trust_remote_code=first.trust_remote_code,
                         lora_dir=first.lora_dir)
        self.kind = first.kind
        self.replicas = list(replicas)
        self.pulled = [0] * len(replicas)  # requests each replica took, over every generate()
        self._settings = settings  # the shard's engine settings: how the requests were dealt lands there
        self._lock = threading.Lock()
        self._joining: queue.Queue | None = None  # the running generate's events: a replica joined
        self._closing = threading.Event()
        self._starter: threading.Thread | None = None

    def start(self) -> EngineInfo:
        raise RuntimeError("a ReplicaSet is made of started engines (start_replicas)")

    def join(self, engine: Engine) -> None:
        """A started replica into the set: a running ``generate`` deals to it from its next request."""
        with self._lock:
            if self._closing.is_set():  # the shard is done with the set: not wanted
                engine.close()
                return
            self.replicas.append(engine)
            self.pulled.append(0)
            if self._settings is not None:
                self._settings["replicas_started"] = len(self.replicas)
            if self._joining is not None:
                self._joining.put(("joined", len(self.replicas) - 1))

    def start_failed(self, i: int, n: int, e: BaseException, say: Callable[[str], None]) -> None:
        if self._settings is not None:
            self._settings.setdefault("replica_errors", []).append(f"replica {i}: {str(e)[-300:]}")
        say(f"engine replica {i} of {n} failed to start; going on with {len(self.replicas)}: {e}")

    def start_later(self, numbers: Iterable[int], n: int, start_one: Callable[[], tuple[Engine, EngineInfo]],
                    say: Callable[[str], None]) -> None:
        """Replicas ``numbers`` (of ``n``) started one after another on a background thread, each joining once
        up; a failed start is left out and said, as is anything else a start raises (the thread ends there)."""
        def run() -> None:
            for i in numbers:
                if self._closing.is_set():
                    return
                try:
                    engine, more = start_one()
                except Exception as e:  # noqa: BLE001 - a replica that does not start is left out, said
                    self.start_failed(i, n, e, say)
                    if not isinstance(e, EngineStartError):
                        return
                    continue
                if self._settings is not None:
                    self._settings.setdefault("replica_start_seconds", []).append(round(more.start_seconds, 1))
                say(f"engine replica {i} of {n} started in {more.start_seconds:.1f}s beside the generation")
                self.join(engine)

        self._starter = threading.Thread(target=run, name="engine-replica-starter", daemon=True)
        self._starter.start()

    def wait_started(self, timeout: float | None = None) -> bool:
        """Waits for the replicas starting in the background; whether none is still starting."""
        if self._starter is not None:
            self._starter.join(timeout)
            return not self._starter.is_alive()
        return True

    def generate(self, requests: Iterable[GenRequest]) -> Iterator[GenResult]:
        stop = threading.Event()
        results: queue.Queue = queue.Queue()  # results, each thread's error and end, replicas joining (never wait)
        room = threading.Semaphore(QUEUE_RESULTS)  # results only: the caller frees a place as it takes one
        with self._lock:
            dealer = Dealer(requests, stop, self.pulled)
            engines = list(self.replicas)
            self._joining = results
        threads: list[threading.Thread] = []

        def serve(i: int, engine: Engine) -> None:
            t = threading.Thread(target=_serve, args=(i, engine, dealer, stop, room, results),
                                 name=f"engine-replica-{i + 1}", daemon=True)
            threads.append(t)
            t.start()

        for i, engine in enumerate(engines):
            serve(i, engine)
        live = len(threads)
        try:
            while live:
                kind, item = results.get()
                if kind == "result":
                    room.release()
                    yield item
                elif kind == "done":
                    live -= 1
                elif kind == "joined":
                    dealer.add(item)
                    serve(item, self.replicas[item])
                    live += 1
                else:
                    raise item
        finally:
            with self._lock:
                self._joining = None
            stop.set()
            for t in threads:
                t.join(JOIN_SECONDS)
            if self._settings is not None:  # the manifest's engine settings: each replica's share of the work
                self._settings["replica_requests"] = list(self.pulled)

    def close(self) -> None:
        self._closing.set()  # a replica starting in the background is closed once up, and no further one starts
        self.wait_started(START_JOIN_SECONDS)
        with self._lock:
            engines = list(self.replicas)
        for engine in engines:
            engine.close()

    @property
    def max_model_len(self) -> int | None:
        return self.replicas[0].max_model_len

    def sampling_for(self, req: GenRequest) -> Sampling:
        return self.replicas[0].sampling_for(req)


def _serve(i: int, engine: Engine, dealer: Dealer, stop: threading.Event, room: threading.Semaphore,
           results: queue.Queue) -> None:
    """Replica ``i``'s thread: its engine's results onto ``results`` (a place in ``room`` each), until its
    stream ends or ``stop``; its failure goes there too, for the caller's thread to raise, and stops the others."""
    stream = engine.generate(dealer.feed(i))
    try:
        for res in stream:
            dealer.finished(i)
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
        dealer.retire(i)
        if isinstance(stream, Generator):  # the engine's own cleanup (vLLM's engine-death watch), in this thread
            stream.close()
        results.put(("done", i))
