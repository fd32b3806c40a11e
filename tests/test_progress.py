"""The worker's rich progress bars draw their count and figures, and refuse a negative total."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from worker.reference.progress import ProgressBar


def test_bar_draws_its_count_and_latest_figures():
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=120)
    with ProgressBar(10, "train eagle head", console=console) as bar:
        bar.update(3).update(4).show(loss="0.512").show(loss="0.498")
    text = out.getvalue()
    assert "train eagle head" in text and "7/10" in text and "loss=0.498" in text
    assert bar.completed == 7


def test_disabled_bar_draws_nothing_and_bad_total_is_refused():
    out = io.StringIO()
    bar = ProgressBar(5, "quiet", enabled=False, console=Console(file=out))
    bar.update(5).show(x=1).close()
    assert out.getvalue() == "" and bar.completed == 5
    with pytest.raises(ValueError, match="progress total must be >= 0, got total=-1"):
        ProgressBar(-1, "bad")


def test_off_a_terminal_the_bar_prints_its_line_as_it_goes():
    out = io.StringIO()
    bar = ProgressBar(4, "distill: target answers", console=Console(file=out, force_terminal=False, width=120),
                      log_every_s=0)
    bar.update(1)
    assert "distill: target answers: 1/4 (25 %)" in out.getvalue()  # printed before the bar stops
    bar.update(2).show(loss=0.5)
    assert "3/4 (75 %)" in out.getvalue()
    bar.close()
    assert "4/4" not in out.getvalue() and out.getvalue().count("distill: target answers") == 3
    with pytest.raises(ValueError, match="log_every_s must be >= 0, got log_every_s=-1"):
        ProgressBar(1, "bad", log_every_s=-1)
