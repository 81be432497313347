"""bench.window_firing (no Ray): the q5 window instance it times emits every (auction, window)
of its key groups once, against a numpy count of the windows that closed."""

from __future__ import annotations

import numpy as np

from tests._bench import put_bench_on_path

put_bench_on_path()

from bench.window_firing import instance_bids, run_once  # noqa: E402


def _closed_windows(auction: np.ndarray, t: np.ndarray, watermark: int) -> int:
    """Distinct (auction, start) of sliding 10 s / 2 s windows with end - 1 <= watermark."""
    pairs = set()
    for a, ts in zip(auction.tolist(), t.tolist(), strict=True):
        last = ts - ts % 2000
        for i in range(5):
            s = last - i * 2000
            if s + 10_000 > ts and s + 10_000 - 1 <= watermark:
                pairs.add((a, s))
    return len(pairs)


def test_window_firing_emits_every_closed_window_once() -> None:
    flow, bids, owned = instance_bids(60_000, 10_000.0, 2)
    assert 0 < bids.num_rows < 60_000  # the bids of one instance's key groups only
    kg, _ = flow.key_space.locate(bids.column("auction").combine_chunks())
    assert np.isin(kg, owned).all()
    result = run_once(flow, bids, owned, batch_rows=200)
    t = bids.column("event_time").to_numpy()
    expected = _closed_windows(bids.column("auction").to_numpy(), t, int(t[-1]) - 1)
    assert result["rows_out"] == expected, (result["rows_out"], expected)
    assert result["firings"] >= 2
    assert result["firing_ms"]["median"] > 0


def test_phase_timer_times_the_firing_and_puts_the_functions_back() -> None:
    import raystream.operators.window_columns as wc
    from bench.window_firing import PhaseTimer

    before = wc.WindowColumns.__dict__["_take_due"]
    flow, bids, owned = instance_bids(30_000, 10_000.0, 2)
    with PhaseTimer() as timer:
        result = run_once(flow, bids, owned, batch_rows=200, phases=timer)
    assert wc.WindowColumns.__dict__["_take_due"] is before
    phases = result["phase_ms_median"]
    assert phases["take due rows"] > 0 and phases["merge partials"] > 0
    assert sum(phases.values()) <= result["firing_ms"]["max"] * 1.5
