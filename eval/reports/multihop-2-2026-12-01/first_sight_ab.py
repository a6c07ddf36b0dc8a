"""First-sight NQ compression time, before (main) vs after (multihop-2), interleaved per question:
one long-lived worker per code version, driven alternately (order alternating per question)."""
import json
import os
import statistics
import subprocess
import sys

WORKER = r'''
import sys, time
from eval.datasets import load_dataset, resolve_dataset_path
from eval.retention import RetentionHarness, split_examples
from policies.loader import load_policy_file, packaged_policy_dir
h = RetentionHarness(first_sight=True)
pol = load_policy_file(packaged_policy_dir() / "rag-default.yaml")
ex = [e for e in split_examples(load_dataset(resolve_dataset_path("/work/shared/data/eval/nq-multidoc-dev.jsonl")).examples, "tune")]
print("ready", flush=True)
for line in sys.stdin:
    r = h.run_one(ex[int(line)], pol)
    print(r.compression_ms, r.details.get("extraction.second_hop"), flush=True)
'''
def start(path):
    env = dict(os.environ, PYTHONPATH=path)
    p = subprocess.Popen([sys.executable, "-c", WORKER], cwd=path, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, stderr=subprocess.DEVNULL)
    assert p.stdout.readline().strip() == "ready"
    return p
n = int(sys.argv[1])
workers = {"before": start(sys.argv[2]), "after": start(sys.argv[3])}
times = {"before": [], "after": []}
fired = 0
for i in range(n):
    order = ["before", "after"] if i % 2 == 0 else ["after", "before"]
    for name in order:
        p = workers[name]
        p.stdin.write(f"{i}\n")
        p.stdin.flush()
        ms, hop = p.stdout.readline().split()
        times[name].append(float(ms))
        fired += name == "after" and hop == "True"
ratios = [a / b for a, b in zip(times["after"], times["before"], strict=True)]
out = {k: {"mean": statistics.mean(v), "median": statistics.median(v)} for k, v in times.items()}
out |= {"median_per_question_ratio": statistics.median(ratios), "mean_ratio": statistics.mean(times["after"]) / statistics.mean(times["before"]), "n": n, "after_fired": fired, "times": times}
print(json.dumps(out))
