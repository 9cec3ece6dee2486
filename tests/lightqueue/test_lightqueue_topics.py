"""Topic names, topic filters and matching against the MQTT 3.1.1 / 5.0 §4.7 rules."""
from __future__ import annotations

import random

import pytest

from lmqtt.lightqueue import (FilterTrie, InvalidTopicFilter, InvalidTopicName, parse_shared,
                              topic_matches, validate_filter, validate_topic)

# (filter, topic, matches) — the spec's own examples plus the corner cases users trip on.
MATCH_TABLE = [
    ("sport/tennis/player1/#", "sport/tennis/player1", True),          # '#' matches the parent
    ("sport/tennis/player1/#", "sport/tennis/player1/ranking", True),
    ("sport/tennis/player1/#", "sport/tennis/player1/score/wimbledon", True),
    ("sport/#", "sport", True),
    ("#", "sport/tennis", True),
    ("#", "/", True),
    ("sport/tennis/+", "sport/tennis/player1", True),
    ("sport/tennis/+", "sport/tennis/player1/ranking", False),
    ("sport/+", "sport", False),
    ("sport/+", "sport/", True),                                        # empty level is a level
    ("+/+", "/finance", True),
    ("/+", "/finance", True),
    ("+", "/finance", False),
    ("+/tennis/#", "sport/tennis", True),
    ("+/+/+", "a/b/c", True),
    ("+/+/+", "a/b", False),
    ("a/+/c", "a//c", True),
    ("a//c", "a//c", True),
    ("a//c", "a/c", False),
    ("a/b", "a/b", True),
    ("a/b", "a/b/", False),
    ("a/b", "A/b", False),                                              # case sensitive
    ("#", "$SYS/broker/load", False),                                   # $ topics vs leading wildcard
    ("+/broker/load", "$SYS/broker/load", False),
    ("$SYS/#", "$SYS/broker/load", True),
    ("$SYS/#", "$SYS", True),
    ("$SYS/+/load", "$SYS/broker/load", True),
    ("+/monitor/Clients", "$SYS/monitor/Clients", False),
    ("$SYS/monitor/+", "$SYS/monitor/Clients", True),
    ("a/$b/#", "a/$b/c", True),                                         # '$' rule is first level only
    ("+/$b", "x/$b", True),
]


@pytest.mark.parametrize("flt,topic,expected", MATCH_TABLE)
def test_topic_matches_table(flt, topic, expected):
    assert topic_matches(validate_filter(flt), validate_topic(topic)) is expected


@pytest.mark.parametrize("flt,topic,expected", MATCH_TABLE)
def test_trie_agrees_with_table(flt, topic, expected):
    t = FilterTrie()
    t.add(flt)
    assert (flt in t.match(topic)) is expected


@pytest.mark.parametrize("bad", ["a/#/b", "a+", "a/b+", "#/a", "a/#b", "+a/b", "", "a/\x00", "##", "a/++"])
def test_invalid_filters_rejected_with_reason_0x8f(bad):
    with pytest.raises(InvalidTopicFilter) as ei:
        validate_filter(bad)
    assert ei.value.reason_code == 0x8F
    assert str(ei.value)  # a message a user can read


@pytest.mark.parametrize("good", ["#", "+", "a/#", "+/+/#", "/", "//", "a//b", "$SYS/#", "a/+/c", "ünï/+"])
def test_valid_filters_accepted(good):
    assert validate_filter(good) == good


@pytest.mark.parametrize("bad", ["", "a/+", "a/#", "#", "a\x00b", "x" * 65536])
def test_invalid_topic_names_rejected_with_reason_0x90(bad):
    with pytest.raises(InvalidTopicName) as ei:
        validate_topic(bad)
    assert ei.value.reason_code == 0x90


def test_topic_length_limit_counts_utf8_bytes():
    validate_topic("x" * 65535)
    with pytest.raises(InvalidTopicName):
        validate_topic("é" * 32768)  # 65,536 bytes in UTF-8


def test_parse_shared():
    assert parse_shared("$share/g1/a/+/c") == ("g1", "a/+/c")
    assert parse_shared("$share/g/#") == ("g", "#")
    assert parse_shared("a/b") == (None, "a/b")
    assert parse_shared("$SYS/x") == (None, "$SYS/x")
    for bad in ["$share/g", "$share//a", "$share/g+/a", "$share/g/a/#/b"]:
        with pytest.raises(InvalidTopicFilter):
            parse_shared(bad)


def test_trie_equals_brute_force_on_random_filters():
    """The trie returns exactly the filters a scan with topic_matches would return."""
    rnd = random.Random(7)
    words = ["a", "b", "", "$x", "c"]
    filters = set()
    for _ in range(400):
        n = rnd.randint(1, 4)
        lv = [rnd.choice(words + ["+"]) for _ in range(n)]
        if rnd.random() < 0.3:
            lv[-1] = "#"
        filters.add("/".join(lv))
    filters.discard("")  # a single empty level is the empty filter: invalid
    t = FilterTrie()
    for f in filters:
        validate_filter(f)
        t.add(f)
    for _ in range(2000):
        topic = "/".join(rnd.choice(words) for _ in range(rnd.randint(1, 5)))
        expected = sorted(f for f in filters if topic_matches(f, topic))
        assert sorted(t.match(topic)) == expected, topic


def test_trie_remove_prunes_and_keeps_others():
    t = FilterTrie()
    for f in ["a/+/c", "a/#", "a/+/d"]:
        t.add(f)
    assert t.remove("a/+/c")
    assert not t.remove("a/+/c")
    assert sorted(t.match("a/b/c")) == ["a/#"]
    assert sorted(t.match("a/b/d")) == ["a/#", "a/+/d"]
    assert len(t) == 2
    t.remove("a/#")
    assert t.match("a") == [] and t.match("a/b/d") == ["a/+/d"]   # '#' gone, parent match too
    t.remove("a/+/d")
    assert t.match("a/b/d") == [] and len(t) == 0
    assert t._root.empty()
