"""Print the score of the last ``mutmut run`` (``make mutants``): per module and in all, and the surviving
mutants that ``tests/mutants_equivalent.md`` does not list as reviewed equivalents.

Score = killed / (killed + survived + timeout + suspicious); "adjusted" also leaves out the survivors reviewed
as equivalent (no user-visible behaviour changes). ``--strict``: exit status 1 while an unreviewed survivor remains.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

REVIEWED = Path(__file__).with_name("mutants_equivalent.md")
COUNTED = ("killed", "survived", "timeout", "suspicious")


def main() -> int:
    out = subprocess.run(
        [str(Path(sys.executable).with_name("mutmut")), "results", "--all", "true"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    status: dict[str, str] = {}
    for line in out.splitlines():
        name, sep, verdict = line.strip().rpartition(": ")
        if sep and "__mutmut_" in name:
            status[name] = verdict
    if not status:
        print("no mutation results: run `make mutants` (mutmut run) first")
        return 1
    reviewed = set(re.findall(r"`([\w.]+__mutmut_\d+)`", REVIEWED.read_text())) if REVIEWED.exists() else set()
    by_module: dict[str, Counter] = defaultdict(Counter)
    for name, verdict in status.items():
        by_module[name.split(".x_")[0].split(".xǁ")[0]][verdict] += 1
    print(f"{'module':45} {'killed':>7} {'survived':>9} {'other':>6}  score")
    total: Counter = Counter()
    for module, counts in sorted(by_module.items()):
        total += counts
        counted = sum(counts[v] for v in COUNTED) or 1  # a module whose mutants no fast test reaches
        other = sum(counts.values()) - counts["killed"] - counts["survived"]
        print(f"{module:45} {counts['killed']:7} {counts['survived']:9} {other:6}  {counts['killed'] / counted:6.1%}")
    counted = sum(total[v] for v in COUNTED)
    survivors = sorted(n for n, v in status.items() if v != "killed" and v in COUNTED)
    equivalent = [n for n in survivors if n in reviewed]
    open_ = [n for n in survivors if n not in reviewed]
    print(f"\nmutation score: {total['killed']}/{counted} = {total['killed'] / counted:.1%} killed")
    adjusted = total["killed"] / max(1, counted - len(equivalent))
    print(f"adjusted for {len(equivalent)} reviewed equivalent survivors ({REVIEWED.name}): {adjusted:.1%}")
    if open_:
        print(f"\n{len(open_)} survivor(s) not reviewed (see each with `mutmut show NAME`):")
        for name in open_:
            print(f"  {name}: {status[name]}")
        return 1 if "--strict" in sys.argv[1:] else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
