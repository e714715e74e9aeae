"""What a training process writes for the orchestrator, declared once: the contract out, as the run
config (`training.config`) is the contract in.

| file                                | model           | written by                        | one a line? |
|-------------------------------------|-----------------|-----------------------------------|-------------|
| `summary.json`                      | `Summary`       | rank 0 at the end of training     | no          |
| `failure.json`, `failure-rank<R>.json` | `FailureRecord` | the first rank to fail, then the others | no    |
| `metrics.jsonl`                     | `Event`         | rank 0, one line an event         | yes         |
| `heartbeat`                         | `Heartbeat`     | rank 0, about once a second       | text        |
| `curves.json`                       | `curves.CurveHistory` | rank 0, every 15 s and at rarer events | no |
| `trainer.json` (in a checkpoint)    | `TrainerState`  | rank 0 at each save               | no          |

Each file is written by one `write_*` function and read by one `read_*` (or `parse_*`) function here;
the orchestrator (the train stage, the attempt history, the stability view) reads through them too.
File names and JSON keys are what they were before the models: the view, the tests and stored runs
read them. Every model has a `version` (VERSION when written); a file from before versions has none
and reads as version 1, whose keys it has.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

VERSION = 1
SUMMARY = "summary.json"
FAILURE_RECORD = "failure.json"
EVENTS = "metrics.jsonl"
HEARTBEAT = "heartbeat"


class _Output(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    version: int = VERSION
    """The contract's version; files written before it had one read as 1."""


class FailureRecord(_Output):
    """Why a rank failed (`training.failure.write_record`): its class and exit code, and where."""

    failure_class: str = Field(alias="class")
    """One of training.failure_classes.FAILURE_CLASSES (a record from another version may name another)."""
    exit_code: int | None = None
    retryable: bool | None = None
    """Written by trainers of version 1 only; never read. Whether to retry is the orchestrator's retry
    policy's alone (the spec's `recovery.policy`, by class)."""
    exception: str = ""
    """`<type>: <message>` of the exception that ended the rank."""
    traceback: list[str] = Field(default_factory=list)
    step: int | None = None
    rank: int | None = None
    host: str | None = None
    pid: int | None = None
    time: float = 0.0
    """Unix time it was written."""

    def as_dict(self) -> dict[str, Any]:
        """The record as its JSON object (key `class`), for code that reads it as one."""
        out = self.model_dump(by_alias=True)
        if out["retryable"] is None:
            del out["retryable"]
        return out


class Summary(_Output):
    """A training run that reached its end (rank 0's `summary.json`)."""

    steps: int
    epochs: int
    stopped_early: bool
    best: dict[str, Any] | None
    """The best validation: step, epoch, value (TrainState.best)."""
    history: list[dict[str, Any]]
    """One record an epoch: epoch, step, lr and the validation scores."""
    best_checkpoint: str | None
    last_checkpoint: str
    world_size: int
    skipped_batches: list[list[int]]
    """[epoch, position] of each batch skipped as poisoned."""
    train_seconds: float
    samples: int
    samples_per_second: float | None


class Event(BaseModel):
    """One line of `metrics.jsonl`: `event` (step, epoch, checkpoint, resume, anomaly, first_step, ...),
    its unix `time`, `step` and `rank`, and the kind's own fields beside them (loss, lr, path, ...)."""

    model_config = ConfigDict(frozen=True, extra="allow")

    event: str = ""
    """The kind; a reader treats a line without one as no kind it knows."""
    time: float
    step: int | float
    rank: int = 0
    version: int = VERSION


class Heartbeat(_Output):
    """Rank 0's latest step and when it was taken: the text `<step> <unix time> <version>`, replaced
    atomically (the orchestrator's hang guard watches its modification time)."""

    step: int
    time: float


class TrainerState(BaseModel):
    """A checkpoint's `trainer.json`: the TrainState (step, epoch, position, history, best, early
    stopping's bad epochs, skipped batches), the world size, the optimizer's part files and why it was
    saved; beside them, passed through whole, the JSON states of the trainer's parts (LR schedule, spike
    detector...) and the model section it can be rebuilt from."""

    model_config = ConfigDict(frozen=True, extra="allow")

    step: int
    epoch: int
    pos: int
    history: list[dict[str, Any]]
    best: dict[str, Any] | None
    bad_epochs: int
    """Epochs since the best one: early stopping's state."""
    skip: list[list[int]]
    world_size: int
    optim_parts: int
    reason: str
    version: int = VERSION


# -- writing: each atomically (a temporary file beside it, then a rename) ---------------------------

def _atomic(path: Path, text: str, tmp_name: str | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / (tmp_name or f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_summary(out_dir: Path, summary: Summary) -> None:
    _atomic(Path(out_dir) / SUMMARY, json.dumps(summary.model_dump(), indent=2))


def write_failure(out_dir: Path, record: FailureRecord) -> Path:
    """`failure.json` when this rank is the first to fail, else `failure-rank<R>.json` beside it: the
    first rank to fail names the cause, the others mostly fail because of it."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".{FAILURE_RECORD}.{record.rank}.tmp"
    tmp.write_text(json.dumps(record.as_dict(), indent=2))
    try:
        os.link(tmp, out_dir / FAILURE_RECORD)
        tmp.unlink()
        return out_dir / FAILURE_RECORD
    except FileExistsError:
        os.replace(tmp, out_dir / f"failure-rank{record.rank}.json")
        return out_dir / f"failure-rank{record.rank}.json"


def event_line(event: Event) -> str:
    """The event as its JSON line: event, time, step, rank, the kind's fields, version. Values go as
    json.dumps writes them (a NaN loss as NaN: the readers map non-finite numbers to None)."""
    data = event.model_dump()
    version = data.pop("version")
    return json.dumps({**data, "version": version}) + "\n"


def write_event(path: Path, event: Event) -> None:
    with open(path, "a") as fh:
        fh.write(event_line(event))


def write_heartbeat(out_dir: Path, beat: Heartbeat) -> None:
    _atomic(Path(out_dir) / HEARTBEAT, f"{beat.step} {beat.time} {beat.version}\n")


def trainer_state(**fields: Any) -> dict[str, Any]:
    """A checkpoint's `trainer.json` object, checked against `TrainerState`, with its version (the
    checkpoint's committer writes it; `training.checkpoint.commit.read_trainer_state` reads it)."""
    return TrainerState(**fields).model_dump()


# -- reading: tolerant of what a kill leaves (a missing file, a cut line) ----------------------------

def read_summary(out_dir: Path) -> Summary:
    """The run's summary; raises OSError or ValueError (pydantic's ValidationError) when it is missing
    or not a summary: a try that ended well wrote one."""
    return Summary.model_validate_json((Path(out_dir) / SUMMARY).read_bytes())


def read_failure(out_dir: Path, name: str = FAILURE_RECORD) -> FailureRecord | None:
    """The failure record `name` in `out_dir`; None when there is none or it cannot be read."""
    try:
        return FailureRecord.model_validate_json((Path(out_dir) / name).read_bytes())
    except (OSError, ValueError):
        return None


def parse_event(line: bytes | str) -> Event | None:
    """One `metrics.jsonl` line; None for a line cut by a kill or one without a finite step and time."""
    try:
        data = json.loads(line)
    except ValueError:
        return None
    if not isinstance(data, dict) or not all(_finite_number(data.get(k)) for k in ("step", "time")):
        return None
    try:
        return Event.model_validate(data)
    except ValidationError:
        return None


def parse_events(lines: list[bytes]) -> tuple[list[dict[str, Any]], int]:
    """Many `metrics.jsonl` lines at once, as `parse_event(line).model_dump()` would give each with its
    non-finite numbers as None, and the number of lines it would refuse: the same contract, decoded in
    one pass (a long run's view reads tens of thousands of lines). A strict decoder (msgspec's, where
    installed: it refuses NaN and numbers beyond a float's range, so every number it returns is
    finite) takes the lines of the common shape; a line it refuses or of an unusual shape goes through
    `parse_event` itself. Blank lines are neither."""
    lines = [line for line in lines if line.strip()]
    decoder = _strict_decoder()
    decoded: list[Any] = []
    if decoder is not None and lines:
        decode, decode_lines = decoder
        try:  # all at once, each line on its own; the last line may be one being written
            decoded = decode_lines(b"\n".join(lines[:-1]))
        except ValueError:
            decoded = []
        if len(decoded) == len(lines) - 1:
            decoded.append(_or_none(decode, lines[-1]))
        else:  # a damaged or NaN line among them: one by one
            decoded = [_or_none(decode, line) for line in lines]
    out, bad = [], 0
    for line, data in zip(lines, decoded or [None] * len(lines)):
        if type(data) is dict and _plain(data):
            data.setdefault("event", "")
            data.setdefault("rank", 0)
            if type(data["time"]) is int:
                data["time"] = float(data["time"])
            data["version"] = data.pop("version", VERSION)
            out.append(data)
            continue
        parsed = parse_event(line)
        if parsed is None:
            bad += 1
            continue
        out.append({k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                    for k, v in parsed.model_dump().items()})
    return out, bad


def _strict_decoder() -> Any:
    try:
        import msgspec
    except ImportError:  # the training image may not have it: every line goes through parse_event
        return None

    decoder = msgspec.json.Decoder()

    def decode(data: bytes) -> Any:
        try:
            return decoder.decode(data)
        except msgspec.DecodeError as exc:
            raise ValueError(str(exc)) from exc

    def decode_lines(data: bytes) -> list[Any]:
        try:
            return decoder.decode_lines(data)
        except msgspec.DecodeError as exc:
            raise ValueError(str(exc)) from exc

    return decode, decode_lines


def _or_none(decode: Any, line: bytes) -> Any:
    try:
        return decode(line)
    except ValueError:
        return None


def _plain(data: dict) -> bool:
    """The common shape `Event` takes as it is: an int or float step and time, an int rank and version,
    a str event (each where present); else `parse_event` decides."""
    step, at = data.get("step"), data.get("time")
    return ((type(step) is int or type(step) is float) and (type(at) is int or type(at) is float)
            and type(data.get("event", "")) is str and type(data.get("rank", 0)) is int
            and type(data.get("version", VERSION)) is int)


def read_events(out_dir: Path, since: float = 0.0) -> list[Event]:
    """The events of `out_dir`'s `metrics.jsonl` from `since` (unix time) on; unreadable lines skipped."""
    try:
        lines = (Path(out_dir) / EVENTS).read_bytes().splitlines()
    except OSError:
        return []
    return [e for line in lines if (e := parse_event(line)) is not None and e.time >= since]


def parse_heartbeat(data: bytes | str | None) -> Heartbeat | None:
    """`<step> <unix time> [<version>]` (no version: written before versions); None when unreadable."""
    parts = (data.decode(errors="replace") if isinstance(data, bytes) else data or "").split()
    try:
        step, at = int(parts[0]), float(parts[1])
        version = int(parts[2]) if len(parts) > 2 else 1
    except (IndexError, ValueError):
        return None
    return Heartbeat(step=step, time=at, version=version) if math.isfinite(at) else None


def read_heartbeat(out_dir: Path) -> Heartbeat | None:
    try:
        return parse_heartbeat((Path(out_dir) / HEARTBEAT).read_bytes())
    except OSError:
        return None


def _finite_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
