"""No infrastructure package reads what a model offers through a private attribute: they read `contract_of(model)`.

A source scan (the AST, so docstrings and comments that mention the old names do not count): the attributes the
contract replaced are never read (`x.name`, `getattr(x, "name")`, `hasattr(x, "name")`) in the infrastructure
packages' sources, except in their `upstream` modules (NeMo AutoModel's spellings, never imported by the core).
`am_model_contract.conventions` is the one place that translates them for a model that declares no contract.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGES = Path(__file__).resolve().parents[2]
INFRASTRUCTURE = ("am-capabilities", "am-context-parallel", "am-pipelining", "am-moe", "am-precision")
# What models used to declare by duck typing, one attribute per fact (issue #21's inventory), and transformers'
# flags that only `conventional_contract` translates.
REPLACED = frozenset(
    {
        "_cp_layout",
        "_owns_cp_attention",
        "_owns_packed_attention",
        "_packed_cp_attn_backends",
        "_cp_attn_backends",
        "_supports_cp_sdpa",
        "_supports_sdpa",
        "_te_attention_injected",
        "_am_is_moe",
        "_pp_keep_self_forward",
        "_pp_plan",
        "pipeline_output_names",
        "get_cp_options",
        "cp_problems",
        "apply_expert_parallel",
    }
)


def _reads(path: Path) -> list[str]:
    """`line: name` for every read of a REPLACED attribute in the module at `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        name = None
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and node.attr in REPLACED:
            name = node.attr
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in REPLACED
        ):
            name = node.args[1].value
        if name is not None:
            found.append(f"{path.relative_to(PACKAGES)}:{node.lineno}: {name}")
    return found


def _sources(package: str) -> list[Path]:
    return [p for p in sorted((PACKAGES / package / "src").rglob("*.py")) if p.name != "upstream.py"]


@pytest.mark.parametrize("package", INFRASTRUCTURE)
def test_infrastructure_reads_no_private_model_attribute(package: str) -> None:
    sources = _sources(package)
    if not sources:
        pytest.skip(f"{package} sources are not in this checkout")
    reads = [read for path in sources for read in _reads(path)]
    assert reads == [], "read the model's contract (am_model_contract.contract_of) instead:\n" + "\n".join(reads)


def test_the_scan_finds_the_reads_where_they_are_translated() -> None:
    """The one module that reads them is found by the same scan (so the test above is not vacuous)."""
    conventions = PACKAGES / "am-model-contract" / "src" / "am_model_contract" / "conventions.py"
    names = {read.rsplit(": ", 1)[1] for read in _reads(conventions)}
    assert {"_owns_cp_attention", "_supports_sdpa", "_pp_keep_self_forward", "_pp_plan"} <= names
