"""memprof.simulate.alloc_stream.check_stream, the check that a stream is the ledger's own: its live bytes at each
recorded moment, never above the run's peak, and never above the peak of the phase an event falls in (a stream
extended by depth whose phase's peak is another moment than the cuts' line reaches is refused:
tests/integration/test_depth_pipeline_stream.py)."""

from __future__ import annotations

import pytest

from memprof.simulate.alloc_stream import check_stream

FREE = -1
# seq, key, bytes (FREE: freed). Live: 100 after seq 1, 300 after 2, 200 after 3, 250 after 4, 50 after 5.
STREAM = [(1, "a", 100), (2, "b", 200), (3, "a", FREE), (4, "c", 50), (5, "b", FREE)]


def test_a_stream_within_its_phases_peaks_passes():
    # Two phases: seqs (0, 3] peaking at 300 B, (3, 5] peaking at 250 B; the moments' figures as the stream holds.
    check_stream(STREAM, 1, {1: 100, 2: 300, 3: 200, 5: 50}, 300, phases=[(0, 3, 300), (3, 5, 250)])


@pytest.mark.parametrize("phases, where", [
    ([(0, 3, 300), (3, 5, 240)], "seq 4"),  # the second phase's record says 240 B; the stream holds 250 B in it
    ([(0, 3, 299), (3, 5, 250)], "seq 2"),  # the first's says 299 B; 300 B at seq 2
])
def test_an_event_above_the_peak_of_its_phase_is_refused(phases, where):
    with pytest.raises(AssertionError, match=f"{where}\\).*above the peak of .* B of the phase it falls in"):
        check_stream(STREAM, 1, {}, 300, phases=phases)


def test_events_outside_every_phase_are_held_to_the_run_s_peak_only():
    # seq 4 and 5 fall in no phase: 250 B there is below the run's 300 B.
    check_stream(STREAM, 1, {}, 300, phases=[(0, 3, 300)])
    with pytest.raises(AssertionError, match="above the figures' peak of 280 B"):
        check_stream(STREAM, 1, {}, 280, phases=[(0, 1, 100)])
