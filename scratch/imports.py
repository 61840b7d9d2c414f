"""Summarise python -X importtime output: total, and the biggest cumulative imports (top level packages)."""
import sys
rows = []
for line in open(sys.argv[1]):
    if not line.startswith("import time:") or "self [us]" in line:
        continue
    self_, cum, name = line.split(":", 1)[1].split("|")
    rows.append((int(self_), int(cum), name.rstrip("\n")))
print(f"total self {sum(r[0] for r in rows) / 1e6:.2f} s")
from collections import Counter
c = Counter()
for s, _, n in rows:
    c[n.strip().split(".")[0]] += s
print("self time by package:", ", ".join(f"{k} {v / 1e6:.2f}" for k, v in c.most_common(15)))
for s, cum, n in sorted(rows, key=lambda r: -r[1])[:25]:
    print(f"{cum / 1e6:7.2f} {s / 1e6:6.2f} {n}")
