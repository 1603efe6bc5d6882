"""A py-spy profile (``py-spy record -f raw``: folded stacks with counts) summarized small enough to read: per
process and thread, how many samples fell in generation (stacks through a ``--within`` frame: by default
``LLM.generate`` in the raw script, the stage's ``stream_requests``, and the engine core's busy loop), and in
generation the functions with the most samples inclusive and as the leaf (``Condition.wait`` as the leaf of a
client's thread: waiting for the engine core's outputs). Used by ``bench/run_gpu.sh profile`` on the GPU host,
where the raw profile is too large to bring back.

    python -m bench profile-summary profile_stage.txt [--within NAME ...] [--top 25]
"""
from __future__ import annotations

import argparse
import collections
import re

FRAME = re.compile(r"^(?P<fn>.+?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def short(frame: str) -> str:
    """``fn (path/to/file.py:12)`` as ``fn file.py`` (no line: one function is one entry)."""
    m = FRAME.match(frame)
    if not m:
        return frame
    return f"{m['fn']} {m['file'].rsplit('/', 1)[-1]}"


def _stacks(path: str):
    """(folded stack, samples) pairs; a command line with newlines in a process frame spans several lines."""
    pending = ""
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            pending += line.rstrip("\n")
            stack, _, count = pending.rpartition(" ")
            if count.isdigit() and stack:
                yield stack, int(count)
                pending = ""
            else:
                pending += " "


def summarize(path: str, within: list[str], top: int) -> str:
    totals: collections.Counter = collections.Counter()
    in_gen: collections.Counter = collections.Counter()
    inclusive: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    leaf: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for stack, n in _stacks(path):
        frames = stack.split(";")
        k = 0
        while k < len(frames) and frames[k].startswith(("process ", "thread ")):
            k += 1
        # the innermost process (its command line, cut) and its thread
        procs = [fr[:100] for fr in frames[:k] if fr.startswith("process ")][-1:]
        threads = [fr for fr in frames[:k] if fr.startswith("thread ")][-1:]
        who = " / ".join(procs + threads) or "?"
        totals[who] += n
        names = [short(fr) for fr in frames[k:]]
        if not any(w in name for name in names for w in within):
            continue
        in_gen[who] += n
        for name in set(names):
            inclusive[who][name] += n
        if names:
            leaf[who][names[-1]] += n
    out = []
    for who, total in totals.most_common():
        out.append(f"== {who}: {total} samples, {in_gen[who]} in generation")
        if not in_gen[who]:
            continue
        g = in_gen[who]
        out.append("   inclusive:")
        out += [f"     {c / g:6.1%} {name[:150]}" for name, c in inclusive[who].most_common(top)]
        out.append("   leaf:")
        out += [f"     {c / g:6.1%} {name[:150]}" for name, c in leaf[who].most_common(top)]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("profile")
    p.add_argument("--within", nargs="*", default=["LLM.generate llm.py", "stream_requests base.py",
                                                   "EngineCoreProc.run_busy_loop core.py"])
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args(argv)
    print(summarize(a.profile, a.within, a.top))

