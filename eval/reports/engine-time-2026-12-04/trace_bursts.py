"""Where a burst's extra first-token time goes: compressed against ideal, chunk by chunk.

Reads the trace files written by a `bench e2e` run with `trace.patch` applied (EXP_TRACE=PREFIX):
PREFIX.arms (arm start times), PREFIX.<pid> (engine steps, engine jobs, compressions, submissions).
For each chunk, the first `concurrency` requests are sent together; their prefill ends with the
first step after which no prompt is left (the first decode-only step starts). Printed per chunk:
when the engine got its first request, the engine-thread time of embedding jobs until then, and
the prefill steps' time net of jobs.

    python trace_bursts.py PREFIX
"""

from __future__ import annotations

import glob
import statistics
import sys


def load(prefix: str):
    arms = [(name, float(at)) for name, at in (line.split() for line in open(prefix + ".arms"))]
    steps, jobs, compressions, submissions = [], [], [], []
    for path in glob.glob(prefix + ".*"):
        if path.endswith(".arms"):
            continue
        for line in open(path):
            parts = line.split()
            if parts[0] == "J":
                jobs.append((float(parts[1]), float(parts[2])))
            elif parts[0] == "C":
                compressions.append(tuple(map(float, parts[1:])))
            elif parts[0] == "A":
                submissions.append(float(parts[1]))
            else:
                steps.append((float(parts[0]), float(parts[1]), int(parts[2]), int(parts[3]), float(parts[4])))
    return arms, sorted(steps), sorted(jobs), sorted(compressions), sorted(submissions)


def burst(arm_start: float, arm_end: float, steps, jobs, submissions):
    """(first submission, end of the burst's prefill, steps of it, job seconds until then)."""
    window = [s for s in steps if arm_start <= s[0] < arm_end]
    first_submit = min(t for t in submissions if arm_start <= t < arm_end)
    prefill = []
    for step in window:
        if step[2] <= step[3]:  # decode only: every prompt of the burst is in
            break
        prefill.append(step)
    end = prefill[-1][0] + prefill[-1][1]
    job_s = sum(d for t, d in jobs if arm_start <= t < end)
    return first_submit - arm_start, end - arm_start, prefill, job_s


def main(prefix: str) -> None:
    arms, steps, jobs, compressions, submissions = load(prefix)
    windows: dict[str, list[tuple[float, float]]] = {}
    for index, (name, start) in enumerate(arms):
        end = arms[index + 1][1] if index + 1 < len(arms) else float("inf")
        windows.setdefault(name, []).append((start, end))
    print("| chunk | compressed: engine starts at ms | jobs until prefill done ms | prefill steps net ms | "
          "burst prefill done ms | ideal: prefill steps ms | burst prefill done ms | difference ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    diffs = []
    for chunk, ((c0, c1), (i0, i1)) in enumerate(zip(windows["compressed"], windows["ideal"], strict=True)):
        c_first, c_end, c_steps, c_jobs = burst(c0, c1, steps, jobs, submissions)
        i_first, i_end, i_steps, _ = burst(i0, i1, steps, jobs, submissions)
        c_net = sum(s[1] - s[4] for s in c_steps) * 1000
        i_net = sum(s[1] - s[4] for s in i_steps) * 1000
        diffs.append((c_end - i_end) * 1000)
        print(f"| {chunk + 1} | {c_first * 1000:.0f} | {c_jobs * 1000:.0f} | {c_net:.0f} | {c_end * 1000:.0f} | "
              f"{i_net:.0f} | {i_end * 1000:.0f} | {diffs[-1]:+.0f} |")
    print(f"\nmedian difference {statistics.median(diffs):+.0f} ms")
    big = {name: [s[1] - s[4] for s in steps if s[2] >= 500 and any(a <= s[0] < b for a, b in windows[name])]
           for name in ("compressed", "ideal")}
    print("512-token steps net of jobs, median ms: "
          + ", ".join(f"{name} {statistics.median(v) * 1000:.0f} (n={len(v)})" for name, v in big.items()))
    runs = [(end - start) * 1000 for submitted, start, end in compressions]
    print(f"compressions (incl. warm-up and /compress fetches): {len(runs)}, run P50 {statistics.median(runs):.0f} ms; "
          f"engine jobs: {len(jobs)}, P50 {statistics.median(d for _, d in jobs) * 1000:.0f} ms")


if __name__ == "__main__":
    main(sys.argv[1])
