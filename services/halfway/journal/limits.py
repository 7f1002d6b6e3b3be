"""Record sizes: what the broker accepts, every consumer of halfway can fetch.

A consumer that cannot fetch a record stalls its partition behind it for good, so every Kafka
consumer in the project takes its fetch limits from here (`AIOKafkaConsumer(...,
**fetch_limits())`).

What aiokafka does with a record batch larger than `max_partition_fetch_bytes`, checked against
the real broker (Kafka 4.x; aiokafka 0.14 fetches with Fetch v4 or later): the broker returns
the first batch of the first non-empty partition of a fetch whole, whatever the limits (KIP-74),
and an empty set for any later partition whose next batch does not fit; aiokafka shuffles the
partitions of every fetch, so the big batch comes in a later round. Nothing stalls, it only
takes more rounds. With a broker that answered a partial batch instead (Fetch < v3), aiokafka
would raise `RecordTooLargeError` and skip the record. With the partition limit at the broker's
own batch limit neither can happen: any batch the broker accepts fits one partition's share of
one fetch.
"""

from __future__ import annotations

from typing import TypedDict

# The broker's `message.max.bytes` default: the largest record batch it accepts. Our topics
# keep it (no `max.message.bytes` override in halfway.contract.topics).
BROKER_BATCH_BYTES_MAX = 1_048_588
# aiokafka's `max_request_size` default, which JournalWriter keeps: the largest record (batch
# header and overhead included, as aiokafka estimates it) a writer can send.
WRITER_RECORD_BYTES_MAX = 1_048_576
# Per partition per fetch: one whole batch of the largest size the broker accepts.
FETCH_PARTITION_BYTES_MAX = BROKER_BATCH_BYTES_MAX
# Per fetch (aiokafka's default, 50 MiB): at least one partition's share.
FETCH_RESPONSE_BYTES_MAX = 52_428_800


class FetchLimits(TypedDict):
    max_partition_fetch_bytes: int
    fetch_max_bytes: int


def fetch_limits() -> FetchLimits:
    """Keyword arguments for AIOKafkaConsumer: any record the broker accepts is fetched."""
    return FetchLimits(max_partition_fetch_bytes=FETCH_PARTITION_BYTES_MAX,
                       fetch_max_bytes=FETCH_RESPONSE_BYTES_MAX)
