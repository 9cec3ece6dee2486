"""Light queues: one CommitLog record, indexed in the queue of its topic and of every matching
registered wildcard filter (RocksDB), plus the store-side metadata MQTT sessions need.

See docs/lightqueue.md for the design and docs/internals.md for the contract.
"""
from .cache import MessageCache
from .errors import InvalidTopicFilter, InvalidTopicName, LightQueueError, MetadataError
from .index import LightQueueIndex
from .index_reads import IndexEntry
from .light_queue_store import LightQueueStore, PullResult
from .metadata import MetadataStore
from .records import SessionRecord, Subscription, WillRecord
from .registry import FilterRegistry
from .topics import is_wildcard, parse_shared, topic_matches, validate_filter, validate_topic
from .trie import FilterTrie

__all__ = [
    "LightQueueStore", "PullResult", "LightQueueIndex", "IndexEntry", "MessageCache",
    "MetadataStore", "SessionRecord", "Subscription", "WillRecord", "FilterRegistry", "FilterTrie",
    "validate_topic", "validate_filter", "topic_matches", "parse_shared", "is_wildcard",
    "LightQueueError", "InvalidTopicName", "InvalidTopicFilter", "MetadataError",
]
