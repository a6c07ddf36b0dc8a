import json
import sys


def load(p):
    return json.load(open(p))
def rows(rep):
    out = {}
    for key, v in rep.items():
        ds, split, budget = key.split("|")
        out[(ds, split, int(budget))] = v
    # whole file = tune + test (ratio of totals, scored answers)
    for (ds, split, b), v in list(out.items()):
        if split != "tune" or (ds, "test", b) not in out:
            continue
        w = out[(ds, "test", b)]
        ret = {**v["retained"], **w["retained"]}
        tok = {**v["tokens"], **w["tokens"]}
        scored = [x for x in ret.values() if x is not None]
        o = sum(t[0] for t in tok.values())
        s = sum(t[1] for t in tok.values())
        out[(ds, "all", b)] = {"summary": {"n_scored": len(scored), "answer_retention": round(sum(scored) / len(scored), 4), "compression_ratio": round(o / s, 3), "fired": v["summary"]["fired"] + w["summary"]["fired"]}}
    return out
before, after = rows(load(sys.argv[1])), rows(load(sys.argv[2]))
print("| dataset | half | budget | before ratio | before retention | after ratio | after retention | n | hop fired (after) |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for key in sorted(after, key=lambda k: (k[0], ["tune", "test", "all"].index(k[1]), -k[2])):
    a = after[key]["summary"]
    b = before.get(key, {}).get("summary", {})
    print(f"| {key[0].split('-')[0]} | {key[1]} | {key[2]} | {b.get('compression_ratio', '')}× | {b.get('answer_retention', '')} | {a['compression_ratio']}× | {a['answer_retention']} | {a['n_scored']} | {a['fired']} |")
