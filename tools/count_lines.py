"""Net source lines that commits changed, counted two ways: physical lines, and lines of code as cloc counts them
(docstrings, comments and blank lines are not code).

Usage: `python tools/count_lines.py REV [REV ...]`. Each REV is compared with its first parent (a merge: what the
merged branch brought). Counted: `packages/*/src` and the reference trainer (`integration_tests/trainer`); a rename
counts as a deletion plus an addition. Prints one row per REV and the total. Standard library and git only.
"""

from __future__ import annotations

import ast
import io
import subprocess
import sys
import tokenize

SOURCES = ("packages/*/src/*.py", "packages/*/src/**/*.py", "integration_tests/trainer/*.py")
_NOT_CODE = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout


def _text(rev: str, path: str) -> str:
    shown = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True)
    return shown.stdout if shown.returncode == 0 else ""  # absent at that revision


def code_lines(source: str) -> int:
    """Lines holding a token that is not a comment, outside module / class / function docstrings."""
    if not source:
        return 0
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                docstrings.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in _NOT_CODE:
            lines.update(n for n in range(token.start[0], token.end[0] + 1) if n not in docstrings)
    return len(lines)


def count(rev: str) -> tuple[int, int]:
    """(net physical lines, net code lines) that `rev` changed against its first parent."""
    physical = 0
    for row in _git("diff", "--no-renames", "--numstat", f"{rev}^1", rev, "--", *SOURCES).splitlines():
        added, removed, _ = row.split("\t", 2)
        physical += int(added) - int(removed)
    paths = _git("diff", "--no-renames", "--name-only", f"{rev}^1", rev, "--", *SOURCES).split()
    code = sum(code_lines(_text(rev, p)) - code_lines(_text(f"{rev}^1", p)) for p in paths)
    return physical, code


def main(revs: list[str]) -> int:
    if not revs:
        print(__doc__)
        return 2
    total = [0, 0]
    print(f"{'rev':<12} {'physical':>9} {'code':>7}")
    for rev in revs:
        physical, code = count(rev)
        total[0] += physical
        total[1] += code
        print(f"{rev:<12} {physical:>+9} {code:>+7}")
    print(f"{'total':<12} {total[0]:>+9} {total[1]:>+7}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
