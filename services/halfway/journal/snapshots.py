"""Snapshots: a restart reads a partition's live state, then only the journal after it.

A follower (decider, executor, reconciler) owns journal partitions; without a snapshot, taking
one over means folding it from offset zero, which grows with all history. A snapshot is the
follower's *image* of one partition at a journal offset X: the journal events of every task
still open (in log order, with their offsets); the events of every task *dormant* (over and
settled for good, waiting out the seal window) as bytes; the ids of sealed tasks by how they
ended; the queue of ended tasks waiting to be sealed; the requests read from the side topic and
where the side topic was read to. Restoring refolds the open tasks' events, which is work in
proportion to live work; a dormant task is decoded only if news of it comes before it is
sealed (most never have any); the journal is read from X on.

Where it lives, Kafka-native and without a second source of truth:
- the image, compressed, in chunks on the `snapshots` topic (time retention: a snapshot is
  disposable), keyed by group and partition;
- a pointer to it (chunk offsets, sizes, a sha256 of the image) in the *commit metadata* of the
  follower's own group on the journal partition, committed with offset X. Kafka keeps the
  pointer and the offset together, atomically, per group and partition, and a restarting
  follower reads both in one request. The group's committed offset had no other use: every
  follower seeks its journal partitions itself.

A snapshot is only an optimisation. Whatever goes wrong reading it (no pointer, an older
format, chunks gone with retention, a digest or a decode that fails) is logged and the
partition is replayed from zero, which gives the same state (a test checks they agree).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import struct
import sys
import time
import zlib
from array import array
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from itertools import accumulate
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from pydantic import TypeAdapter

from halfway import log
from halfway.contract import CompensationAttempted, Event, StepAttempted, TaskRequested
from halfway.contract.topics import SNAPSHOTS
from halfway.core.fold import TaskStatus
from halfway.journal.limits import fetch_limits
from halfway.journal.sealed import unpack
from halfway.journal.writer import JournalWriter
from halfway.settings import KafkaSettings, number_from_env

FORMAT = 5
READS = {4, FORMAT}  # an image of the format before is read (and soon rewritten) after an upgrade
MAGIC = b"halfway-snapshot\n"
# When a follower writes a partition's snapshot: after this many records applied since the
# last one, or this long after it with anything applied, or this long after it regardless (so
# the pointed-to chunks never age out of the topic's retention on a quiet journal).
EVERY_RECORDS = 50_000
EVERY_S = 300.0
REFRESH_S = 86_400.0
EVERY_S_ENV = "HALFWAY_SNAPSHOT_EVERY_S"  # EVERY_S, for tests and operators
# `HALFWAY_SNAPSHOTS=off`: never read or write snapshots (every restart replays from zero).
ENABLED_ENV = "HALFWAY_SNAPSHOTS"


def enabled(wanted: bool) -> bool:
    """Whether a service that `wanted` snapshots reads and writes them (ENABLED_ENV)."""
    return wanted and os.environ.get(ENABLED_ENV, "on").lower() != "off"


def every_s() -> float:
    return number_from_env(EVERY_S_ENV, EVERY_S)  # 0: after every record (tests)


def due(records: int, age_s: float, every_s: float) -> bool:
    """Whether a partition's snapshot is due, `records` applied and `age_s` seconds since its
    last one (see EVERY_RECORDS; `every_s`: `every_s()`, read once by its caller)."""
    return records >= EVERY_RECORDS or (records > 0 and age_s >= every_s) or age_s >= REFRESH_S
# Chunks stay well under the broker's record limit (halfway.journal.limits).
CHUNK_BYTES = 512 * 1024
# Past this (compressed) a partition is not snapshotted: its restart replays from zero, logged.
IMAGE_BYTES_MAX = 512 * 1024 * 1024
# Reading one snapshot back: the records scanned past the first chunk (other partitions'
# chunks share the topic partition) and the time allowed, before giving up on it.
READ_RECORDS_MAX = 100_000
READ_TIMEOUT_S = 60.0
READ_FETCH_BYTES = 32 * 1024 * 1024  # per fetch of a snapshot's chunks
# Fetching the group's pointers on assignment (in the rebalance listener): past this, the
# partitions are replayed from zero rather than the assignment kept waiting.
POINTERS_TIMEOUT_S = 10.0
# Images read (and decoded) at once: two overlap one's fetch with the other's decode. More only
# share the CPU (the last partition is served no sooner, the first later) and hold every image
# in memory at once (10M events, 6 partitions: peak RSS 270-290 MiB at once, 190-205 by two).
READS_AT_ONCE = 2
COMPRESS_LEVEL = 1  # speed over size: the image is read back at every restart
# What compressed bytes of an image may unpack to: this many times their size, and this much
# besides (a dormant task's few hundred bytes, with the preset dictionary, unpack far beyond
# the ratio). Our images unpack about 5 to 10 times; a zlib bomb a thousand times (a 1.5 MB
# image took a restart to 3 GB of memory before it was found corrupt).
UNPACKED_RATIO_MAX = 50
UNPACKED_SLACK_BYTES = 1024 * 1024

_EVENTS = TypeAdapter(list[Event])
_REQUESTS = TypeAdapter(list[TaskRequested])
_REQUEST = TypeAdapter(TaskRequested)
_LEN = struct.Struct(">Q")
# The preset dictionary of a dormant task's compressed JSON: the contract's own shape of a
# task's events, values left out (a payload is a few hundred bytes, too short to learn it
# itself; with it, a task of six events takes about 500). Changing it changes FORMAT.
ZDICT = (
    b'{"event_id":"","task_id":"","at":"","schema_version":1,"type":"task.requested",'
    b'"input":{},"allowed_tools":[],"policy":{"saga":false,"max_steps":20,"deadline":null,'
    b'"on_unknown":"wait"},"requested_by":null}{"event_id":"","task_id":"","at":"",'
    b'"schema_version":1,"type":"task.started","input":{},"allowed_tools":[],"policy":{'
    b'"saga":false,"max_steps":20,"deadline":null,"on_unknown":"wait"}}{"event_id":"",'
    b'"task_id":"","at":"","schema_version":1,"step_id":"","type":"step.intended","n":1,'
    b'"tool":"","args":{},"key":"","subject":null,"effect_class":"keyed","saga_role":null,'
    b'"compensation":null,"decided_by":{"model":"","version":null,"usage":null,"app":null},'
    b'"also_proposed":[],"claim_id":null}{"event_id":"","task_id":"","at":"",'
    b'"schema_version":1,"step_id":"","type":"step.attempted","attempt":1,"key":"",'
    b'"started_at":""}{"event_id":"","task_id":"","at":"","schema_version":1,"step_id":"",'
    b'"outcome":"done","evidence":{},"reason":null,"source":"call","attempt":1,'
    b'"effect_id":null,"contradiction":null,"replayed":false,"type":"step.settled"}'
    b'{"event_id":"","task_id":"","at":"","schema_version":1,"type":"task.finished",'
    b'"state":"succeeded","summary":"","decided_by":null}')
_ZDICT_ID = zlib.adler32(ZDICT).to_bytes(4, "big")  # what a payload's zlib header names


@dataclass(frozen=True, slots=True)
class Dormant:
    """A task over and settled for good, not yet sealed, as the follower keeps it: its
    journal events (and its request from the side topic) as compressed JSON, decoded only if
    it has news. About 700 bytes for a task of six events."""

    task_id: str
    status: str  # how it ended
    offsets: Sequence[int]  # of its journal events, in order
    first_attempts: Sequence[Sequence[Any]]  # (effect key, offset of its first attempt)
    payload: bytes  # zlib (ZDICT) of: its events' JSON list, "\n", its request's JSON or ""

    def decode(self) -> tuple[list[tuple[int, Event]], TaskRequested | None]:
        raw = _unpacked(self.payload, zlib.decompressobj(zdict=ZDICT))
        events_json, _, request_json = raw.partition(b"\n")  # JSON holds no raw newline
        events = _EVENTS.validate_json(events_json)
        if len(events) != len(self.offsets):
            raise UnusableSnapshot(f"task {self.task_id}: event offsets and events differ")
        request = _REQUEST.validate_json(request_json) if request_json else None
        return list(zip(self.offsets, events, strict=True)), request

    @classmethod
    def of(cls, task_id: str, status: str, history: list[tuple[int, Event]],
           request: TaskRequested | None, *, first_attempts: bool = True) -> Dormant:
        """`first_attempts`: keep the first attempt of each effect key (the followers' fence
        against a second attempt needs them; the projector's rows do not)."""
        first: dict[str, int] = {}
        for offset, event in history if first_attempts else ():
            if isinstance(event, StepAttempted | CompensationAttempted):
                first.setdefault(event.key, offset)
        raw = _EVENTS.dump_json([e for _, e in history]) + b"\n" + (
            b"" if request is None else _REQUEST.dump_json(request))
        packer = zlib.compressobj(COMPRESS_LEVEL, zdict=ZDICT)
        return cls(task_id, status, tuple(o for o, _ in history), tuple(first.items()),
                   packer.compress(raw) + packer.flush())


# A task made dormant since the last image: (task id, status, its history, its request).
Quiet = tuple[str, str, list[tuple[int, Event]], TaskRequested | None]


@dataclass
class Image:
    """A follower's state of one journal partition, just before journal offset `journal_next`."""

    partition: int
    journal_next: int
    side_next: int | None  # where to read the side topic's partition of the same number from
    events: list[tuple[int, Event]] = field(default_factory=list)  # (offset, event), log order
    requests: list[TaskRequested] = field(default_factory=list)
    sealed: bytes = b""  # the partition's sealed tasks (halfway.journal.sealed)
    ended: list[tuple[datetime, str]] = field(default_factory=list)  # waiting to be sealed
    dormant: list[Dormant] = field(default_factory=list)  # as read, or kept since
    quiet: list[Quiet] = field(default_factory=list)  # dormant since, encoded with the image
    format: int = FORMAT  # of the bytes it was read from
    # What the service keeps with the image (JSON; the follower's `OnImage`): the outcomes
    # publisher's knowledge of its own topic.
    service: dict[str, Any] | None = None
    # The seal window it was folded with (`seal_window`: inf, never); None: not recorded (an
    # image of an older build). A restart with another window replays instead (`load_each`):
    # the sealed tasks would differ from a replay's.
    seal_after_s: float | None = None


def seal_window(after: timedelta | float | None) -> float:
    """The seal window as an image records it: seconds, inf for never."""
    if after is None:
        return math.inf
    return after.total_seconds() if isinstance(after, timedelta) else float(after)


class UnusableSnapshot(Exception):
    """Why a snapshot cannot be used: the partition is replayed from zero instead."""


def encode(image: Image) -> bytes:
    """The image's bytes: its header, open tasks, requests and the index of its dormant and
    ended tasks (binary columns: a restart parses them in a few milliseconds) compressed; the
    dormant tasks' payloads (compressed each) and the sealed digests (random) as they are."""
    # The sealed digests' order is checked here, where they are written, not at every read:
    # a read checks the image's sha256 against the pointer, so it gets these very bytes, and
    # the check costs a restart 30 ms a partition (270k digests at 10M journal events).
    unpack(image.sealed)  # raises ValueError: `write_and_point` logs it, writes nothing
    dormant = [*image.dormant, *(Dormant.of(*q) for q in image.quiet)]
    header: dict[str, Any] = {
        "v": FORMAT, "partition": image.partition, "journal_next": image.journal_next,
        "side_next": image.side_next, "offsets": [o for o, _ in image.events],
        "dormant": len(dormant), "ended": len(image.ended)}
    if image.service is not None:
        header["service"] = image.service
    if image.seal_after_s is not None:
        header["seal_after_s"] = "never" if math.isinf(image.seal_after_s) else \
            image.seal_after_s
    firsts = [pair for d in dormant for pair in d.first_attempts]
    columns = [
        _ids(d.task_id for d in dormant),
        bytes(_STATUS_CODE[d.status] for d in dormant),
        _le("I", (len(d.offsets) for d in dormant)),
        _le("q", (o for d in dormant for o in d.offsets)),
        _le("I", (len(d.first_attempts) for d in dormant)),
        _ids(key for key, _ in firsts),
        _le("q", (offset for _, offset in firsts)),
        _le("I", (len(d.payload) for d in dormant)),
        _le("q", ((at - _EPOCH) // _MICROSECOND for at, _ in image.ended)),
        _ids(task_id for _, task_id in image.ended)]
    packed = _framed([json.dumps(header, separators=(",", ":")).encode(),
                      _EVENTS.dump_json([e for _, e in image.events]),
                      _REQUESTS.dump_json(image.requests), *columns])
    return MAGIC + _framed([zlib.compress(packed, COMPRESS_LEVEL),
                            b"".join(d.payload for d in dormant), image.sealed])


# The index's columns: ids and keys (ASCII, no newline: the contract's patterns) joined by
# newlines; numbers as little-endian arrays.
_STATUSES = (TaskStatus.FINISHED.value, TaskStatus.REJECTED.value)  # a dormant task's status
_STATUS_CODE = {status: code for code, status in enumerate(_STATUSES)}
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)
_COLUMNS = 10


def _ids(items: Iterable[str]) -> bytes:
    return "\n".join(items).encode("ascii")


def _from_ids(raw: bytes, count: int) -> list[str]:
    out = raw.decode("ascii").split("\n") if count else []
    if len(out) != count:
        raise UnusableSnapshot(f"{len(out)} ids where the index says {count}")
    return out


def _le(typecode: str, numbers: Iterable[int]) -> bytes:
    values = array(typecode, numbers)
    if sys.byteorder != "little":
        values.byteswap()
    return values.tobytes()


def _from_le(typecode: str, raw: bytes, count: int | None = None) -> array[int]:
    values = array(typecode)
    values.frombytes(raw)  # raises ValueError on a length that is not a multiple
    if sys.byteorder != "little":
        values.byteswap()
    if count is not None and len(values) != count:
        raise UnusableSnapshot(f"{len(values)} numbers where the index says {count}")
    return values


def _framed(parts: list[bytes]) -> bytes:
    return b"".join(_LEN.pack(len(p)) + p for p in parts)


def _unframed(body: bytes, count: int) -> list[bytes]:
    parts, at = [], 0
    for _ in range(count):
        (n,) = _LEN.unpack_from(body, at)
        if at + _LEN.size + n > len(body):
            raise UnusableSnapshot("a part runs past the end")
        parts.append(body[at + _LEN.size:at + _LEN.size + n])
        at += _LEN.size + n
    if at != len(body):
        raise UnusableSnapshot("bytes after the last part")
    return parts


def decode(blob: bytes) -> Image:
    """The image's open tasks and requests are validated; dormant tasks' payloads are only cut
    out (their events are validated if and when they are decoded); the sealed digests' order
    was checked by `encode`. Reads this build's format and the one before it (`Image.format`
    says which: an older one is rewritten soon)."""
    if not blob.startswith(MAGIC):
        raise UnusableSnapshot("not a snapshot (no magic)")
    try:
        packed, payloads, sealed = _unframed(blob[len(MAGIC):], 3)
        unpacked = _unpacked(packed, zlib.decompressobj())
        (n,) = _LEN.unpack_from(unpacked)
        header = json.loads(unpacked[_LEN.size:_LEN.size + n])
        version = header.get("v")
        if version not in READS:
            raise UnusableSnapshot(f"format {version!r}, this build reads {sorted(READS)}")
        parts = _unframed(unpacked, 3 + (_COLUMNS if version == FORMAT else 0))
        events = _EVENTS.validate_json(parts[1])
        offsets = header["offsets"]
        if len(offsets) != len(events):
            raise UnusableSnapshot("event offsets and events differ in number")
        if version == FORMAT:
            dormant, ended = _index(header, parts[3:], payloads)
        else:
            dormant, ended = _index_v4(header, payloads)
        if dormant and dormant[0].payload[2:6] != _ZDICT_ID:
            raise UnusableSnapshot("dormant tasks compressed with another dictionary")
        unpack(sealed, check=False)  # raises ValueError on a length; the order: `encode`
        return Image(
            partition=int(header["partition"]), journal_next=int(header["journal_next"]),
            side_next=None if header["side_next"] is None else int(header["side_next"]),
            events=list(zip(offsets, events, strict=True)),
            requests=_REQUESTS.validate_json(parts[2]), sealed=sealed, ended=ended,
            dormant=dormant, format=int(version), service=_service(header.get("service")),
            seal_after_s=_window(header.get("seal_after_s")))
    except UnusableSnapshot:
        raise
    except Exception as exc:  # zlib, struct, JSON or validation: a corrupt image
        raise UnusableSnapshot(f"corrupt image: {type(exc).__name__}: {str(exc)[:300]}") from exc


def _unpacked(packed: bytes, unpacker: Any) -> bytes:
    """`packed` decompressed, within UNPACKED_RATIO_MAX times its size (plus the slack);
    UnusableSnapshot past it, found without unpacking the rest."""
    limit = UNPACKED_RATIO_MAX * len(packed) + UNPACKED_SLACK_BYTES
    raw = unpacker.decompress(packed, limit)
    if unpacker.unconsumed_tail:
        raise UnusableSnapshot(f"{len(packed)} compressed bytes unpack to more than {limit}: "
                               f"not an image of ours")
    return bytes(raw) + unpacker.flush()


def _window(value: Any) -> float | None:
    if value is None:
        return None
    if value == "never":
        return math.inf
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise UnusableSnapshot("its seal window is not a number")
    return float(value)


def _service(value: Any) -> dict[str, Any] | None:
    if value is not None and not isinstance(value, dict):
        raise UnusableSnapshot("the service's part is not an object")
    return value


def _index(header: dict[str, Any], columns: list[bytes],
           payloads: bytes) -> tuple[list[Dormant], list[tuple[datetime, str]]]:
    """Dormant and ended tasks from the index's columns (format 5)."""
    (ids, statuses, counts, offsets, first_counts, first_keys, first_offsets, sizes,
     ended_at, ended_ids) = columns
    n = int(header["dormant"])
    task_ids = _from_ids(ids, n)
    if len(statuses) != n:
        raise UnusableSnapshot("dormant statuses and tasks differ in number")
    counts_ = _from_le("I", counts, n)
    offsets_ = _from_le("q", offsets, sum(counts_))
    first_counts_ = _from_le("I", first_counts, n)
    first_offsets_ = _from_le("q", first_offsets, sum(first_counts_))
    keys = _from_ids(first_keys, len(first_offsets_))
    sizes_ = _from_le("I", sizes, n)
    if sum(sizes_) != len(payloads):
        raise UnusableSnapshot("dormant tasks' bytes do not add up")
    # Each task's slice of the columns, between running sums (one pass, no per-task lookups).
    ends, first_ends, payload_ends = accumulate(counts_), accumulate(first_counts_), \
        accumulate(sizes_)
    status_of = [_STATUSES[code] for code in statuses]
    pairs = list(zip(keys, first_offsets_, strict=True))
    dormant = [Dormant(task_id, status, offsets_[o - c:o], tuple(pairs[f - fc:f]),
                       payloads[at - size:at])
               for task_id, status, c, o, fc, f, size, at in zip(
                   task_ids, status_of, counts_, ends, first_counts_, first_ends, sizes_,
                   payload_ends, strict=True)]
    m = int(header["ended"])
    ended = [(_EPOCH + us * _MICROSECOND, task_id) for us, task_id in
             zip(_from_le("q", ended_at, m), _from_ids(ended_ids, m), strict=True)]
    return dormant, ended


def _index_v4(header: dict[str, Any],
              payloads: bytes) -> tuple[list[Dormant], list[tuple[datetime, str]]]:
    """Dormant and ended tasks from a format-4 header (JSON lists): the image a build before
    this one wrote, read once after an upgrade instead of replaying the partition."""
    dormant, at = [], 0
    for task_id, status, task_offsets, firsts, size in header["dormant"]:
        if status not in _STATUS_CODE:
            raise UnusableSnapshot(f"not how a task ends: {str(status)[:40]}")
        dormant.append(Dormant(task_id, status, task_offsets, firsts, payloads[at:at + size]))
        at += size
    if at != len(payloads):
        raise UnusableSnapshot("dormant tasks' bytes do not add up")
    return dormant, [(datetime.fromisoformat(at), str(t)) for at, t in header["ended"]]


@dataclass(frozen=True, slots=True)
class Pointer:
    """What the group's commit metadata says of a snapshot: where its chunks are."""

    snapshot_id: str
    topic_partition: int
    first_offset: int
    chunks: int
    size: int
    sha256: str

    def metadata(self) -> str:
        # The broker keeps at most `offset.metadata.max.bytes` (4096 by default): ~200 here.
        return json.dumps({"v": FORMAT, "id": self.snapshot_id, "p": self.topic_partition,
                           "o": self.first_offset, "n": self.chunks, "b": self.size,
                           "h": self.sha256}, separators=(",", ":"))

    @classmethod
    def parse(cls, metadata: str) -> Pointer:
        try:
            m: dict[str, Any] = json.loads(metadata)
            if m.get("v") not in READS:
                raise UnusableSnapshot(f"pointer format {m.get('v')!r}")
            return cls(str(m["id"]), int(m["p"]), int(m["o"]), int(m["n"]), int(m["b"]),
                       str(m["h"]))
        except UnusableSnapshot:
            raise
        except Exception as exc:
            raise UnusableSnapshot(f"unreadable pointer: {type(exc).__name__}") from exc


def key_of(group: str, partition: int) -> bytes:
    return f"{group}/{partition}".encode()


async def write(writer: JournalWriter, group: str, image: Image, blob: bytes) -> Pointer:
    """Append the image's chunks (acks=all, in order) and return the pointer to commit."""
    snapshot_id = f"{image.partition}-{image.journal_next}-{int(time.time() * 1000)}"
    chunks = [blob[i:i + CHUNK_BYTES] for i in range(0, len(blob), CHUNK_BYTES)] or [b""]
    first: Any = None
    for i, chunk in enumerate(chunks):
        sent = await writer.append_raw(
            SNAPSHOTS, chunk, key=key_of(group, image.partition),
            headers=[("snapshot", snapshot_id.encode()), ("chunk", f"{i}/{len(chunks)}".encode())])
        if first is None:
            first = sent
    return Pointer(snapshot_id, first.partition, first.offset, len(chunks), len(blob),
                   hashlib.sha256(blob).hexdigest())


async def write_and_point(writer: JournalWriter, group: str, image: Image,
                          commit: Callable[[str], Awaitable[bool]], logger: Any) -> bool:
    """Encode `image` (in a thread), append its chunks, then `commit` the pointer's metadata
    with the image's offset (False: the partition is no longer the writer's). Logged either
    way; True once committed. A failure (a rebalance, the broker) is only logged: the next
    image is due soon anyway."""
    started = time.monotonic()
    try:
        blob = await asyncio.to_thread(encode, image)
        if len(blob) > IMAGE_BYTES_MAX:
            logger.warning("partition too large to snapshot: its restart replays it",
                           partition=image.partition, bytes=len(blob))
            return False
        pointer = await write(writer, group, image, blob)
        if not await commit(pointer.metadata()):
            return False  # revoked meanwhile: the new owner writes its own
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        logger.warning("snapshot not written", partition=image.partition,
                       error=f"{type(exc).__name__}: {exc}"[:300])
        return False
    logger.info("snapshot written", partition=image.partition,
                journal_next=image.journal_next, live_events=len(image.events),
                dormant=len(image.dormant) + len(image.quiet),
                sealed=len(image.sealed) // 8, bytes=len(blob),
                seconds=round(time.monotonic() - started, 3))
    return True


async def pointers(settings: KafkaSettings, group: str,
                   tps: list[TopicPartition]) -> dict[TopicPartition, tuple[int, str]]:
    """The group's committed (offset, metadata) of each journal partition that has one."""
    admin = AIOKafkaAdminClient(**settings.client())
    await admin.start()
    try:
        committed = await admin.list_consumer_group_offsets(group, partitions=tps)
    finally:
        await admin.close()
    return {tp: (om.offset, om.metadata or "") for tp, om in committed.items()
            if om is not None and om.offset is not None and om.offset >= 0}


def reader(settings: KafkaSettings) -> AIOKafkaConsumer:
    """A consumer for `read` (not started): a restart's reads share one, which spares each
    image a connection of its own (a SCRAM exchange and a metadata request: 16 ms of CPU)."""
    # An image is read in as few fetches as the broker allows (its chunks are consecutive
    # records of one partition): a restart waits for it.
    limits = fetch_limits()
    return AIOKafkaConsumer(
        **settings.client(), group_id=None, enable_auto_commit=False,
        check_crcs=False,  # the image's sha256 is checked against the pointer
        max_partition_fetch_bytes=max(READ_FETCH_BYTES, limits["max_partition_fetch_bytes"]),
        fetch_max_bytes=max(READ_FETCH_BYTES, limits["fetch_max_bytes"]))


async def read(consumer: AIOKafkaConsumer, settings: KafkaSettings, group: str, partition: int,
               pointer: Pointer) -> bytes:
    """The image's bytes, checked against the pointer, with `consumer` (`reader`, started; one
    read at a time: it is assigned the image's topic partition alone). Raises
    UnusableSnapshot."""
    tp = TopicPartition(SNAPSHOTS.name(settings.topic_prefix), pointer.topic_partition)
    key = key_of(group, partition)
    consumer.assign([tp])
    try:
        start = (await consumer.beginning_offsets([tp]))[tp]
        if start > pointer.first_offset:
            raise UnusableSnapshot("its chunks were deleted (retention)")
        consumer.seek(tp, pointer.first_offset)
        chunks: list[bytes] = []
        scanned = 0
        async with asyncio.timeout(READ_TIMEOUT_S):
            while len(chunks) < pointer.chunks:
                batch = await consumer.getmany(tp, timeout_ms=1000)
                records = batch.get(tp, [])
                if not records and await consumer.position(tp) >= (
                        await consumer.end_offsets([tp]))[tp]:
                    raise UnusableSnapshot(f"only {len(chunks)} of {pointer.chunks} chunks")
                for record in records:
                    scanned += 1
                    headers = dict(record.headers or ())
                    if (record.key == key
                            and headers.get("snapshot") == pointer.snapshot_id.encode()):
                        chunks.append(record.value or b"")
                if scanned > READ_RECORDS_MAX + pointer.chunks:
                    raise UnusableSnapshot(f"chunks not found within {READ_RECORDS_MAX} records")
    except TimeoutError:
        raise UnusableSnapshot(f"not read within {READ_TIMEOUT_S:.0f} s") from None
    finally:
        consumer.pause(tp)  # nothing more fetched ahead (the next read assigns its own)
    blob = b"".join(chunks[:pointer.chunks])
    if len(blob) != pointer.size or hashlib.sha256(blob).hexdigest() != pointer.sha256:
        raise UnusableSnapshot("its digest does not match the pointer")
    return blob


async def _snapshotted(settings: KafkaSettings, group: str, tps: list[TopicPartition],
                       ) -> dict[TopicPartition, tuple[int, str]]:
    """`pointers`, of the partitions that have one (none if they cannot be fetched within
    POINTERS_TIMEOUT_S: logged)."""
    try:
        async with asyncio.timeout(POINTERS_TIMEOUT_S):
            committed = await pointers(settings, group, tps)
    except Exception as exc:
        log.get("halfway.snapshots", group=group).warning(
            "no snapshots read: the group's commits could not be fetched",
            error=f"{type(exc).__name__}: {exc}"[:300])
        return {}
    return {tp: pointer for tp, pointer in committed.items() if pointer[1]}


async def load_each(settings: KafkaSettings, group: str, tps: list[TopicPartition], *,
                    wanted: bool = True, seal_after_s: float | None = None,
                    side: str | None = None) -> AsyncIterator[tuple[int, Image | None]]:
    """(partition, its usable image or None) for each journal partition in `tps`, in the
    order they are read (those without a snapshot first): a follower serves each one as soon
    as it is restored. None: replay that partition from zero (every one, unless `wanted`; one
    folded with another seal window than `seal_after_s`, `seal_window`'s, when given; one
    that starts past the end of its journal partition, or of its `side` topic's partition)."""
    logger = log.get("halfway.snapshots", group=group)
    committed = await _snapshotted(settings, group, tps) if wanted else {}

    at_once = asyncio.Semaphore(READS_AT_ONCE)  # images held: fetched or being decoded
    one_fetch = asyncio.Lock()  # the shared consumer reads one image at a time
    consumer: AIOKafkaConsumer | None = None

    async def fetched(tp: TopicPartition, pointer: Pointer) -> bytes:
        nonlocal consumer
        async with one_fetch:
            if consumer is None:
                starting = reader(settings)
                try:
                    await starting.start()
                except BaseException:
                    await starting.stop()
                    raise
                consumer = starting
            return await read(consumer, settings, group, tp.partition, pointer)

    async def past_the_end(tp: TopicPartition, image: Image) -> str | None:
        """Why `image` starts past where its partitions end now, if it does: restored, every
        record the log writes up to there would be skipped (the log lost records, an unclean
        leader election or a restore from backup, or the image is not of this log)."""
        starts = {tp: image.journal_next}
        if side is not None and image.side_next is not None:
            starts[TopicPartition(side, tp.partition)] = image.side_next
        async with one_fetch:
            assert consumer is not None  # `fetched` started it
            ends = await consumer.end_offsets(list(starts))
        for part, start in starts.items():
            if start > ends[part]:
                return (f"it starts at offset {start} of {part.topic} partition "
                        f"{part.partition}, past its end ({ends[part]})")
        return None

    async def one(tp: TopicPartition) -> tuple[int, Image | None]:
        offset, metadata = committed.get(tp, (0, ""))
        if not metadata:
            return tp.partition, None
        started = time.monotonic()
        try:
            pointer = Pointer.parse(metadata)
            async with at_once:  # one image's decode goes on while the next is fetched
                image = await asyncio.to_thread(decode, await fetched(tp, pointer))
            if image.partition != tp.partition or image.journal_next != offset:
                raise UnusableSnapshot("it describes another partition or offset")
            if (beyond := await past_the_end(tp, image)) is not None:
                raise UnusableSnapshot(beyond)
            if None not in (seal_after_s, image.seal_after_s) and \
                    image.seal_after_s != seal_after_s:
                raise UnusableSnapshot(f"folded with a seal window of {image.seal_after_s} s, "
                                       f"now {seal_after_s} s (HALFWAY_SEAL_AFTER_S)")
        except UnusableSnapshot as exc:
            logger.warning("snapshot not used; the partition is replayed from zero",
                           partition=tp.partition, reason=str(exc))
            return tp.partition, None
        except Exception as exc:
            logger.warning("snapshot not read; the partition is replayed from zero",
                           partition=tp.partition, error=f"{type(exc).__name__}: {exc}"[:300])
            return tp.partition, None
        logger.info("snapshot read", partition=tp.partition, journal_next=image.journal_next,
                    live_events=len(image.events), dormant=len(image.dormant),
                    sealed=len(image.sealed) // 8, format=image.format,
                    bytes=pointer.size, seconds=round(time.monotonic() - started, 3))
        return tp.partition, image

    reads = [asyncio.ensure_future(one(tp)) for tp in tps]
    try:
        for done in asyncio.as_completed(reads):
            yield await done
    finally:
        for read_ in reads:
            read_.cancel()  # the caller stopped early (revoked, or stopping)
        if consumer is not None:
            await asyncio.gather(*reads, return_exceptions=True)  # none uses it any more
            await consumer.stop()


async def load(settings: KafkaSettings, group: str, tps: list[TopicPartition], *,
               seal_after_s: float | None = None) -> dict[int, Image]:
    """The usable image of each journal partition in `tps`; the others replay from zero."""
    return {number: image async for number, image in load_each(
        settings, group, tps, seal_after_s=seal_after_s) if image is not None}
