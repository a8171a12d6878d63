"""Reproducible reruns: every run records each measurement a decision reads ([`Tape`]); `AdaptiveBatch(replay=PATH)`
reads them in place of the clock. See docs/how-it-works.md, "Reproducible reruns". Pure Python."""

from __future__ import annotations

import copy
import json
import logging
import os

logger = logging.getLogger("adaptive_batch")

FORMAT = 1  # the layout of the file; raise it when a key changes meaning
FILE = "adaptive_batch_measurements.json"


def file_name(rank: int, world_size: int) -> str:
    """The record's file for one process (one per rank under several processes: each measures its own)."""
    return FILE if world_size == 1 else FILE.replace(".json", f".rank{rank}.json")


class Tape:
    """One run's measurements (`streams`: `{stream: {step: [[tag, *values], ...]}}`), and while replaying the
    record's (`source`); `ended` says why a replay ended early."""

    def __init__(self, run: dict | None = None):
        self.run = run
        self.streams: dict[str, dict[str, list]] = {}
        self.source: dict[str, dict[str, list]] | None = None
        self.path: str | None = None
        self.ended: str | None = None
        self._read: dict[tuple[str, str], int] = {}  # (stream, step): entries of the source read so far

    @property
    def replaying(self) -> bool:
        return self.source is not None and self.ended is None

    def replay(self, record: dict, path: str) -> None:
        self.source, self.path, self.ended, self._read = record["streams"], path, None, {}

    def continue_from(self, record: dict) -> None:
        self.streams = copy.deepcopy(record["streams"])

    def measure(self, stream: str, step: int, tag: str, live: list) -> list:
        """Records `live` (`tag` names what); returns what decisions read: the record's values while replaying."""
        values = live
        if self.replaying:
            recorded, matched = self._take(stream, step, tag)
            if matched:
                values = list(recorded[1:])
            else:
                held = "nothing more" if recorded is None else f"{recorded[0]!r}"
                self._end(f"at step {step} this run measured {tag!r} where the record holds {held}")
        self._append(stream, step, [tag, *values])
        return values

    def recorded_failure(self, stream: str, step: int, tag: str) -> bool:
        """Whether the recorded run ran out of memory here: the replay then fails this micro-batch (or piece) unrun."""
        if not self.replaying or not self._take(stream, step, tag)[1]:
            return False
        self._append(stream, step, [tag])
        return True

    def failure(self, stream: str, step: int, tag: str) -> None:
        if self.replaying:
            self._end(f"at step {step} this run ran out of memory ({tag!r}) where the recorded run did not")
        self._append(stream, step, [tag])

    def keyed(self, stream: str, step: int, live: list | None) -> list | None:
        """A measurement some runs cannot take (the step before a resumed run's first): the record's, else `live`."""
        values = live
        if self.replaying:
            entries = self.source.get(stream, {}).get(str(step), [])
            recorded = list(entries[0][1:]) if entries else None
            if recorded is not None and live is not None and recorded[:-1] != live[:-1]:
                self._end(
                    f"at step {step} this run timed a step of {live[:-1]} where the record timed {recorded[:-1]}"
                )
            else:
                values = recorded
        if values is not None:
            self._append(stream, step, ["time", *values])
        return values

    def write(self, path: str) -> None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        record = {
            "format": FORMAT,
            "run": self.run,
            "replayed": self.path,
            "replay_ended": self.ended,
            "streams": self.streams,
        }
        temporary = path + ".tmp"
        with open(temporary, "w", encoding="utf-8") as handle:
            json.dump(record, handle, separators=(",", ":"))
        os.replace(temporary, path)

    def _take(self, stream: str, step: int, tag: str) -> tuple[list | None, bool]:
        """The source's next entry here (`None`: none left), and whether it is a `tag` one, then read."""
        key = (stream, str(step))
        entries, index = self.source.get(stream, {}).get(key[1], []), self._read.get(key, 0)
        recorded = entries[index] if index < len(entries) else None
        matched = recorded is not None and recorded[0] == tag
        if matched:
            self._read[key] = index + 1
        return recorded, matched

    def _append(self, stream: str, step: int, entry: list) -> None:
        self.streams.setdefault(stream, {}).setdefault(str(step), []).append(entry)

    def _end(self, why: str) -> None:
        self.ended = why
        logger.warning(
            f"AdaptiveBatch: the replay of {self.path} ends: {why}. From here the run measures for itself, so the "
            "rest is not bit for bit the recorded run."
        )


def read_record(path: str, rank: int, world_size: int) -> tuple[dict, str]:
    """The record at `path` (a file, or a folder holding this rank's file) and the file read; `ValueError` if none."""
    name = file_name(rank, world_size)
    file = os.path.join(path, name) if os.path.isdir(path) else path
    if world_size > 1 and not os.path.isdir(path):
        raise ValueError(
            f"replay={path!r} is a file, and under {world_size} processes each rank replays its own record. Pass "
            f"the folder the recorded run wrote its {file_name(0, world_size)} ... files into (its output_dir, or a "
            "checkpoint folder)."
        )
    if not os.path.isfile(file):
        raise ValueError(
            f"replay={path!r}: there is no {file}. Pass the {name} that a run with AdaptiveBatch wrote into its "
            "output_dir (or a checkpoint folder), or that folder itself."
        )
    try:
        with open(file, encoding="utf-8") as handle:
            record = json.load(handle)
    except (OSError, ValueError) as error:
        raise ValueError(f"replay={path!r}: {file} is not a readable JSON record ({error}).") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT or "streams" not in record:
        raise ValueError(
            f"replay={path!r}: {file} is not a record of measurements of layout {FORMAT} (this release's). Pass a "
            f"{FILE} written by this release of adaptive-batch."
        )
    return record, file


def differences(recorded: dict | None, now: dict) -> list[str]:
    """What differs between a record's run description and this run's, one phrase per value."""
    recorded, now = _flat(recorded or {}), _flat(json.loads(json.dumps(now, default=repr)))
    changed = [name for name in sorted(set(recorded) | set(now)) if recorded.get(name) != now.get(name)]
    if len(changed) > 1 and "plan.fingerprint" in changed:  # named only where nothing else says why
        changed.remove("plan.fingerprint")
    return [
        f"{name}: {recorded.get(name, 'nothing')!r} in the record, {now.get(name, 'nothing')!r} now"
        for name in changed
    ]


def replay_error(path: str, changed: list[str]) -> str:
    return (
        f"replay={path!r} was recorded by another run than this one, so its measurements would not decide this run's "
        f"cuts, batch changes and eval batches as they decided the recorded run's (a replay needs the same dataset, "
        f"plan, world size and AdaptiveBatch settings). Changed: {'; '.join(changed)}. Run with the recorded run's "
        "settings, or leave replay out (replay=None) to measure afresh."
    )


def _flat(value: dict, prefix: str = "") -> dict:
    flat = {}
    for key, item in value.items():
        if isinstance(item, dict):
            flat.update(_flat(item, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = item
    return flat
