"""Print one closing line, 'tests: N passed, N failed, N skipped', summed over pytest JUnit XML files.

Exits non-zero when no test ran at all or when any test failed or errored, so CI cannot pass on an empty run.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET


def main(paths: list[str]) -> int:
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for path in paths:
        root = ET.parse(path).getroot()
        for suite in root.iter("testsuite"):
            for key in totals:
                totals[key] += int(suite.get(key, 0))
    failed = totals["failures"] + totals["errors"]
    passed = totals["tests"] - failed - totals["skipped"]
    print(f"tests: {passed} passed, {failed} failed, {totals['skipped']} skipped")
    if totals["tests"] == 0:
        print("no test ran: check that pytest collected the packages' tests", file=sys.stderr)
        return 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
