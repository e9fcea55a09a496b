"""bench/frontend_floor.py: each adapter's receive() beside the bare work of its wire format, per message."""

from __future__ import annotations

from qasr.bench import frontend_floor


def test_the_floor_table_has_every_part_of_every_protocol():
    text = frontend_floor.main(["--batches", "1", "--chunk-ms", "20"])
    rows = [line.split("|")[1:-1] for line in text.splitlines()[2:]]
    assert [row[0].strip() for row in rows] == ["native", "openai", "deepgram"]
    for row in rows:
        websocket, wire, adapter = (float(cell) for cell in row[1:4])
        assert websocket > 0 and wire > 0 and adapter > 0
        assert abs(float(row[4]) - (adapter - wire)) < 0.011  # the adapter's own part
    assert rows[0][5].strip() == "0"  # native against itself
    assert "20 ms of 24 kHz" in text.splitlines()[0]
