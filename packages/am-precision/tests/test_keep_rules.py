"""Keep-rule collection and matching: strict first, dedup, list/tuple/set, wrapper segments, malformed lists."""

from __future__ import annotations

import pytest
from torch import nn

from am_precision import KeepRule, canonical_name, fp32_keep_rules, match_keep_rule


def model_with(strict=None, non_strict=None) -> nn.Module:
    model = nn.Linear(2, 2)
    model._keep_in_fp32_modules_strict = strict  # type: ignore[assignment]
    model._keep_in_fp32_modules = non_strict  # type: ignore[assignment]
    return model


def test_no_attributes_means_no_rules():
    assert fp32_keep_rules(nn.Linear(2, 2)) == ()
    assert fp32_keep_rules(model_with(None, None)) == ()


def test_strict_first_then_non_strict_deduplicated_in_order():
    rules = fp32_keep_rules(model_with(["head", "bias", "head"], ["norm", "head", "rotary_emb", "norm"]))
    assert rules == (
        KeepRule("head", strict=True),
        KeepRule("bias", strict=True),
        KeepRule("norm", strict=False),
        KeepRule("rotary_emb", strict=False),
    )


@pytest.mark.parametrize("container", [list, tuple, set, frozenset])
def test_list_tuple_and_set_are_accepted(container):
    rules = fp32_keep_rules(model_with(container(["b_strict"]), container(["norm", "a_emb"])))
    assert {(r.keyword, r.strict) for r in rules} == {("b_strict", True), ("norm", False), ("a_emb", False)}
    assert rules[0] == KeepRule("b_strict", strict=True)


def test_sets_give_a_deterministic_order():
    assert fp32_keep_rules(model_with(None, {"zeta", "alpha", "mid"})) == tuple(
        KeepRule(k, strict=False) for k in ("alpha", "mid", "zeta")
    )


def test_bare_string_is_rejected_with_a_fix():
    with pytest.raises(TypeError, match=r"_keep_in_fp32_modules must be a list.*write \['norm'\]"):
        fp32_keep_rules(model_with(None, "norm"))


def test_non_string_entries_are_listed():
    with pytest.raises(TypeError, match=r"invalid entries: \[3, ''\]"):
        fp32_keep_rules(model_with(["ok", 3, ""], None))


def test_substring_matching_on_dotted_names_through_wrappers():
    rules = (KeepRule("router.e_score_correction_bias", strict=True), KeepRule("layers.0.norm", strict=False))
    assert match_keep_rule("layers.3.mlp.router.e_score_correction_bias", rules) == rules[0]
    assert match_keep_rule("layers.0._checkpoint_wrapped_module.norm.weight", rules) == rules[1]
    assert match_keep_rule("_orig_mod.layers.0.norm.weight", rules) == rules[1]
    assert match_keep_rule("layers.1.norm.weight", rules) is None
    assert canonical_name("a._checkpoint_wrapped_module.b._orig_mod.c") == "a.b.c"


def test_strict_rule_wins_when_both_match():
    rules = fp32_keep_rules(model_with(["head.bias"], ["head"]))
    assert match_keep_rule("lm_head.bias", rules) == KeepRule("head.bias", strict=True)
    assert match_keep_rule("lm_head.weight", rules) == KeepRule("head", strict=False)
