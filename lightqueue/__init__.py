"""Light queues: one CommitLog record, indexed in the queue of its topic and of every matching
registered wildcard filter (RocksDB), plus the store-side metadata MQTT sessions need.

See docs/lightqueue.md for the design and docs/internals.md for the contract.
"""
from lmqtt.store.lazy_exports import lazy_exports

# The API names load their modules on first use (PEP 562), as lmqtt.store's do: a gateway names
# the light queues' vocabulary (`lmqtt.lightqueue.topics`, `.records`, `.errors`) and must not load
# RocksDB and the index with it (a fleet gateway has no RocksDB: tests/architecture/test_runtime_imports.py).
_WHERE = {
    "MessageCache": ".cache",
    "InvalidTopicFilter": ".errors", "InvalidTopicName": ".errors", "LightQueueError": ".errors",
    "MetadataError": ".errors",
    "LightQueueIndex": ".index", "IndexEntry": ".index_reads",
    "LightQueueStore": ".light_queue_store", "PullResult": ".light_queue_store",
    "MetadataStore": ".metadata",
    "SessionRecord": ".records", "Subscription": ".records", "WillRecord": ".records",
    "FilterRegistry": ".registry",
    "is_wildcard": ".topics", "parse_shared": ".topics", "topic_matches": ".topics",
    "validate_filter": ".topics", "validate_topic": ".topics",
    "FilterTrie": ".trie",
}

__getattr__ = lazy_exports(__name__, _WHERE, globals())


__all__ = [
    "LightQueueStore", "PullResult", "LightQueueIndex", "IndexEntry", "MessageCache",
    "MetadataStore", "SessionRecord", "Subscription", "WillRecord", "FilterRegistry", "FilterTrie",
    "validate_topic", "validate_filter", "topic_matches", "parse_shared", "is_wildcard",
    "LightQueueError", "InvalidTopicName", "InvalidTopicFilter", "MetadataError",
]
