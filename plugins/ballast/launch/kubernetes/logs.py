"""Follow a try's pod logs: one thread a pod streams its container's log (`follow=True`), and the
owner relays the lines on its own thread (`PodLogs.drain`). Nothing is read twice but the few seconds a
reconnect asks for again, which the line timestamps drop.

What the API guarantees, and what this relies on:

- `read_namespaced_pod_log(follow=True)` streams the container's log from its start (or from
  `since_seconds` before the kubelet's now) and keeps the connection open for new lines until the
  container ends; then it closes. A stream may also be cut (an API server's or proxy's timeout, a
  network error) while the container runs.
- `timestamps=True` prefixes each line with the runtime's RFC3339(Nano) time of receipt, in the log's
  order. After a cut, the follower reconnects asking `since_seconds` back from the kubelet's now to
  `OVERLAP_SECONDS` before its last line's time (the worker's and the node's clocks agree to within
  that: NTP), and drops the lines at or before the last one relayed by their timestamps, as the
  provider's `PodManager.fetch_container_logs` resumes. A reconnect serves again only those seconds.
- A pod's container that restarts (in place) ends its stream; the reconnect reads the new container's
  lines, all stamped after the old one's. A Job's replacement pod (a new name) gets a follower of its
  own; a replacement's lines are relayed only once the pod it replaced has been read to its end, so a
  completion index's lines stay in order across the restart.

Threads end with their owner: `PodLogs.close` tells every follower its pod ended, waits (bounded) for
the streams to end, then closes what is left and returns; the threads are daemons besides.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

OVERLAP_SECONDS = 5
"""Asked for again on a reconnect, before the last line's time: the clocks' disagreement, rounding."""
RETRY_SECONDS = 2.0
READ_TIMEOUT_SECONDS = 300
"""A stream quiet this long is reopened (as the provider does): a dead connection is noticed."""
CLOSE_SECONDS = 30.0
"""How long `close` waits for the followers to read their pods' logs to the end."""


def parse_stamp(line: str) -> tuple[tuple[int, int] | None, str]:
    """`<RFC3339 time> <text>` -> ((unix seconds, nanoseconds), text); (None, line) when not stamped."""
    stamp, sep, text = line.partition(" ")
    if not sep and not stamp.endswith("Z"):
        return None, line
    head, dot, frac = stamp.partition(".")
    zone = ""
    if dot:
        digits = len(frac) - len(frac.lstrip("0123456789"))
        frac, zone = frac[:digits], frac[digits:]
    else:
        for i in range(len(head) - 1, 9, -1):
            if head[i] in "Z+-":
                head, zone = head[:i], head[i:]
                break
    try:
        at = datetime.fromisoformat(head + (zone.replace("Z", "+00:00") or "+00:00"))
    except ValueError:
        return None, line
    nanos = int((frac + "000000000")[:9]) if frac else 0
    return (int(at.timestamp()), nanos), text


class Follower(threading.Thread):
    """One pod's container log, streamed into the owner's queue as (pod, line)."""

    def __init__(self, core: Any, namespace: str, pod: str, container: str, prefix: str, out: queue.Queue,
                 log: Any, *, seq: int):
        super().__init__(name=f"log-{pod}", daemon=True)
        self.core, self.namespace, self.pod, self.container = core, namespace, pod, container
        self.prefix, self.out, self.log, self.seq = prefix, out, log, seq
        self.ended = threading.Event()    # the pod has ended (or is gone): read to the stream's end, then stop
        self.cancelled = threading.Event()
        self.ended_at = 0.0
        self.last: tuple[int, int] | None = None   # the timestamp of the last line relayed
        self.at_last = 0                            # lines relayed with exactly that timestamp
        self._skip = 0
        self._response: Any = None
        self._lock = threading.Lock()

    def run(self) -> None:
        while not self.cancelled.is_set():
            final = self.ended.is_set()  # set before this read: the container has ended, this read is its end
            try:
                self._read_stream()
            except Exception as exc:  # noqa: BLE001  (a cut stream, a pod not started or gone: read again)
                self.log.debug("log of %s interrupted: %s", self.pod, exc)
                if final:
                    return
            else:
                if final:
                    return
            if self.cancelled.wait(RETRY_SECONDS if not self.ended.is_set() else 0.0):
                return

    def _read_stream(self) -> None:
        kwargs: dict[str, Any] = {}
        if self.last is not None:  # from a little before the last line relayed, not from the start
            kwargs["since_seconds"] = max(1, math.ceil(time.time() - self.last[0] - self.last[1] / 1e9)
                                          + OVERLAP_SECONDS)
        response = self.core.read_namespaced_pod_log(
            self.pod, self.namespace, container=self.container, follow=True, timestamps=True,
            _preload_content=False, _request_timeout=(60, READ_TIMEOUT_SECONDS), **kwargs)
        with self._lock:
            self._response = response
        self._skip = self.at_last  # this stream's lines stamped `last` that were relayed already
        if self.cancelled.is_set():
            _close(response)
            return
        try:
            rest = b""
            for chunk in response.stream(amt=None, decode_content=True):
                if self.cancelled.is_set():
                    return
                rest += chunk
                *lines, rest = rest.split(b"\n")
                for raw in lines:
                    self._line(raw)
            if rest:
                self._line(rest)
        finally:
            with self._lock:
                self._response = None
            _close(response)

    def _line(self, raw: bytes) -> None:
        stamp, text = parse_stamp(raw.decode("utf-8", errors="backslashreplace").rstrip("\r"))
        if stamp is not None and self.last is not None:
            if stamp < self.last:
                return  # read before the reconnect
            if stamp == self.last and self._skip > 0:
                self._skip -= 1  # one of the lines of that very time read before the reconnect
                return
        if stamp is not None:
            self.at_last = self.at_last + 1 if stamp == self.last else 1
            self.last = stamp
        self.out.put((self, f"{self.prefix}{text}"))

    def cancel(self) -> None:
        """Stop now: close the stream being read (the thread's read returns)."""
        self.cancelled.set()
        with self._lock:
            response = self._response
        if response is not None:
            _close(response)


def _close(response: Any) -> None:
    for name in ("close", "release_conn"):
        try:
            getattr(response, name)()
        except Exception:  # noqa: BLE001,S110  (closing what may be closed already)
            pass


class PodLogs:
    """The followers of one try's pods; lines reach `on_line` only through `drain`, on the owner's thread."""

    def __init__(self, core: Any, namespace: str, container: str, log: Any):
        self.core, self.namespace, self.container, self.log = core, namespace, container, log
        self.queue: queue.Queue = queue.Queue()
        self.followers: dict[str, Follower] = {}
        self.held: dict[Follower, list[str]] = {}

    def follow(self, pods: list[Any], *, prefix: Callable[[Any], str]) -> None:
        """Start a follower for each started pod not followed yet; tell those of ended or vanished pods."""
        listed = set()
        for pod in pods:
            name = pod.metadata.name
            listed.add(name)
            phase = pod.status.phase if pod.status else None
            if phase in (None, "Pending"):
                continue
            f = self.followers.get(name)
            if f is None:
                f = self.followers[name] = Follower(self.core, self.namespace, name, self.container, prefix(pod),
                                                    self.queue, self.log, seq=len(self.followers))
                f.start()
            if phase in ("Succeeded", "Failed", "Unknown"):
                self._end(f)
        for name, f in self.followers.items():
            if name not in listed:
                self._end(f)

    def _end(self, f: Follower) -> None:
        """The pod has ended: its follower reads to the end; one still reading CLOSE_SECONDS later (a
        read hung on a lost node's connection) is stopped, so a replacement's lines are not held."""
        now = time.monotonic()
        if not f.ended.is_set():
            f.ended_at = now
            f.ended.set()
        elif f.is_alive() and now - f.ended_at > CLOSE_SECONDS:
            self.log.warning("log of pod %s not read to its end in %.0f s: stopped", f.pod, CLOSE_SECONDS)
            f.cancel()

    def drain(self, on_line: Callable[[str], Any]) -> None:
        """Relay the lines read so far; a replacement pod's only after the pods before it of its prefix
        (its completion index) are read to their end."""
        while True:
            try:
                f, line = self.queue.get_nowait()
            except queue.Empty:
                break
            self.held.setdefault(f, []).append(line)
        for f in sorted(self.held, key=lambda f: f.seq):
            if any(g.seq < f.seq and g.prefix == f.prefix and g.is_alive() for g in self.followers.values()):
                continue
            for line in self.held.pop(f):
                on_line(line)

    def close(self, on_line: Callable[[str], Any], *, timeout: float | None = None) -> None:
        """The pods have ended (or were deleted): read every log to its end (at most `timeout`), relay,
        stop the followers left."""
        for f in self.followers.values():
            f.ended.set()
        timeout = CLOSE_SECONDS if timeout is None else timeout
        deadline = time.monotonic() + timeout
        for f in self.followers.values():
            f.join(max(0.0, deadline - time.monotonic()))
        for f in self.followers.values():
            if f.is_alive():
                self.log.warning("log of pod %s not read to its end in %.0f s: stopped", f.pod, timeout)
                f.cancel()
                f.join(5.0)
        self.drain(on_line)
        for f in [*self.held]:  # a follower still alive after cancel: its lines too
            for line in self.held.pop(f):
                on_line(line)
