"""Schedule pictures: timelines from torch's action lists, bubble fractions against the textbook formulas,
text/SVG/PNG output."""

from __future__ import annotations

import builtins
import xml.etree.ElementTree as ET

import pytest

from am_pipelining import render_svg, render_text, save_schedule_picture, schedule_timeline, textbook_bubble_fraction

ALL = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


@pytest.mark.parametrize("name", ["GPipe", "1F1B"])
@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 4), (3, 7)])
def test_measured_bubble_equals_textbook_formula(name, p, m):
    timeline = schedule_timeline(name, pp_size=p, n_microbatches=m)
    assert timeline.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    assert timeline.textbook_bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("name", ALL)
def test_every_schedule_has_a_complete_timeline(name):
    timeline = schedule_timeline(name, pp_size=2, n_microbatches=4)
    stages = 2 * timeline.stages_per_rank
    forwards = {(a.stage, a.microbatch) for a in timeline.actions if a.kind == "F"}
    assert forwards == {(s, mb) for s in range(stages) for mb in range(4)}
    assert 0.0 <= timeline.bubble_fraction < 0.5
    lines = render_text(timeline).splitlines()
    assert lines[0].startswith("rank 0:")
    assert lines[1].startswith("rank 1:")
    assert name in lines[-1]


def test_interleaving_and_zero_bubble_shrink_the_bubble():
    one = schedule_timeline("1F1B", pp_size=4, n_microbatches=8).bubble_fraction
    interleaved = schedule_timeline("Interleaved1F1B", pp_size=4, n_microbatches=8)
    assert interleaved.bubble_fraction < one
    assert interleaved.bubble_fraction == pytest.approx(3 / (2 * 8 + 3))
    assert schedule_timeline("ZBVZeroBubble", pp_size=4, n_microbatches=8).bubble_fraction < one


def test_textbook_formulas():
    assert textbook_bubble_fraction("gpipe", p=4, m=8)[0] == pytest.approx(3 / 11)
    assert textbook_bubble_fraction("interleaved1f1b", p=4, m=8, v=2)[0] == pytest.approx(3 / 19)
    assert textbook_bubble_fraction("zbvzerobubble", p=4, m=8, v=2)[0] == 0.0
    assert textbook_bubble_fraction("dualpipev", p=4, m=8)[0] is None


def test_svg_and_text_files(tmp_path):
    timeline = schedule_timeline("1F1B", pp_size=2, n_microbatches=4)
    root = ET.fromstring(render_svg(timeline))
    assert root.tag.endswith("svg")
    assert len([e for e in root.iter() if e.tag.endswith("rect")]) == len(timeline.actions)
    text_path = save_schedule_picture(timeline, tmp_path / "s.txt")
    with open(text_path) as f:
        assert "bubble=0.2000" in f.read()


def test_png_with_matplotlib_and_clear_error_without(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    timeline = schedule_timeline("GPipe", pp_size=2, n_microbatches=2)
    path = save_schedule_picture(timeline, tmp_path / "s.png")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("no matplotlib")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(ImportError, match=r"am-pipelining\[plot\]"):
        save_schedule_picture(timeline, tmp_path / "t.png")


def test_sizes_are_required_for_names():
    with pytest.raises(ValueError, match="pp_size and n_microbatches"):
        schedule_timeline("1F1B")
