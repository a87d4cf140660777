"""Checks of an exported trace (iris.tracing): the Chrome trace format as Perfetto reads it, and
events that nest on each track."""

from __future__ import annotations

PHASES = {"X", "i", "M"}


def check_chrome_trace(trace: dict, world_size: int) -> list[str]:
    """What is wrong with ``trace`` (empty when nothing): every event has the fields its phase
    needs, every rank is a named process, and on each track (process, thread) the complete events
    nest: one starts and ends inside another, or after it ended."""
    problems = []
    events = trace.get("traceEvents")
    if not isinstance(events, list) or not events:
        return ["no traceEvents list"]
    named = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    if named != set(range(world_size)):
        problems.append(f"processes named: {sorted(named)}, expected ranks 0..{world_size - 1}")
    tracks: dict[tuple, list[tuple[float, float, str]]] = {}
    for e in events:
        if e.get("ph") not in PHASES or not isinstance(e.get("name"), str) or not isinstance(e.get("pid"), int):
            problems.append(f"malformed event {e}")
            continue
        if e["ph"] == "M":
            continue
        if not isinstance(e.get("tid"), int) or not isinstance(e.get("ts"), (int, float)) or e["ts"] < 0:
            problems.append(f"event without a track or a time {e}")
        elif e["ph"] == "X":
            if not isinstance(e.get("dur"), (int, float)) or e["dur"] < 0:
                problems.append(f"complete event without a duration {e}")
            else:
                tracks.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"], e["name"]))
    for track, spans in tracks.items():
        open_ends: list[tuple[float, str]] = []
        for start, end, name in sorted(spans, key=lambda s: (s[0], -s[1])):
            while open_ends and open_ends[-1][0] <= start:
                open_ends.pop()
            if open_ends and end > open_ends[-1][0]:
                problems.append(f"track {track}: {name} [{start}, {end}] overlaps {open_ends[-1][1]} without nesting")
            open_ends.append((end, name))
    return problems
