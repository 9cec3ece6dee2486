"""MQTT topic names and topic filters (MQTT 3.1.1 §4.7, MQTT 5.0 §4.7).

Why here: light-queue names *are* topics and filters, so the rules that decide which filter
sees which topic must be the same on the publish side (which queues get an index entry) and on
the subscribe side (which filters are legal). The gateway calls these functions; it does not
re-implement them.

Rules implemented:
- a topic name is non-empty, has no `+`/`#` and no NUL, and is at most 65,535 bytes of UTF-8;
- a filter is non-empty, `#` is only the last level and alone in it, `+` is alone in its level;
- `#` also matches the parent level (`a/#` matches `a`); empty levels are levels (`a//b`);
- topics starting with `$` are not matched by a filter whose first level is `+` or `#`.
"""
from __future__ import annotations

from .errors import InvalidTopicFilter, InvalidTopicName

MAX_TOPIC_BYTES = 65535
SHARE_PREFIX = "$share/"


def _check_common(s: str, what: str, exc: type) -> None:
    if not isinstance(s, str):
        raise exc(f"{what} must be a str, got {type(s).__name__}")
    if not s:
        raise exc(f"{what} must not be empty")
    if "\x00" in s:
        raise exc(f"{what} must not contain U+0000 (NUL)")
    try:
        n = len(s.encode("utf-8"))
    except UnicodeEncodeError as e:  # lone surrogates
        raise exc(f"{what} is not valid UTF-8: {e}") from None
    if n > MAX_TOPIC_BYTES:
        raise exc(f"{what} is {n} bytes of UTF-8, the limit is {MAX_TOPIC_BYTES}")


def validate_topic(topic: str) -> str:
    """Return `topic` if it is a legal PUBLISH topic name, else raise InvalidTopicName (0x90)."""
    _check_common(topic, "topic name", InvalidTopicName)
    if "+" in topic or "#" in topic:
        raise InvalidTopicName(f"topic name {topic!r} must not contain wildcards '+' or '#'")
    return topic


def validate_filter(flt: str) -> str:
    """Return `flt` if it is a legal topic filter, else raise InvalidTopicFilter (reason 0x8F).

    Shared-subscription prefixes are not accepted here: strip them with `parse_shared` first.
    """
    _check_common(flt, "topic filter", InvalidTopicFilter)
    levels = flt.split("/")
    last = len(levels) - 1
    for i, lv in enumerate(levels):
        if "#" in lv:
            if lv != "#":
                raise InvalidTopicFilter(f"topic filter {flt!r}: '#' must occupy a whole level")
            if i != last:
                raise InvalidTopicFilter(f"topic filter {flt!r}: '#' must be the last level")
        elif "+" in lv and lv != "+":
            raise InvalidTopicFilter(f"topic filter {flt!r}: '+' must occupy a whole level")
    return flt


def is_wildcard(flt: str) -> bool:
    """True when the filter has `+` or `#` (and so needs its own light queue)."""
    return "+" in flt or "#" in flt


def topic_matches(flt: str, topic: str) -> bool:
    """Does the (valid) filter `flt` match the (valid) topic name `topic`?"""
    if topic.startswith("$") and flt[:1] in ("+", "#"):
        return False
    f = flt.split("/")
    t = topic.split("/")
    nf, nt = len(f), len(t)
    i = 0
    while i < nf:
        fl = f[i]
        if fl == "#":
            return True  # matches this level and everything below, including the parent
        if i >= nt:
            return False
        if fl != "+" and fl != t[i]:
            return False
        i += 1
    return nt == nf


def parse_shared(flt: str) -> tuple[str | None, str]:
    """Split `$share/{group}/{filter}` into (group, filter); other filters give (None, flt).

    Raises InvalidTopicFilter for a malformed shared filter (empty group, wildcard in the group
    name, or no filter after the group), as MQTT 5.0 §4.8.2 requires.
    """
    if not isinstance(flt, str) or not flt.startswith(SHARE_PREFIX):
        return None, flt
    rest = flt[len(SHARE_PREFIX):]
    group, sep, inner = rest.partition("/")
    if not group or "+" in group or "#" in group:
        raise InvalidTopicFilter(f"shared subscription {flt!r}: invalid share name {group!r}")
    if not sep or not inner:
        raise InvalidTopicFilter(f"shared subscription {flt!r}: missing topic filter after the share name")
    validate_filter(inner)
    return group, inner


def literal_prefix(flt: str) -> str:
    """The leading levels of `flt` that contain no wildcard, joined by '/'.

    `a/b/+/c` -> `a/b`, `a/#` -> `a`, `+/x` -> `` (empty: no prefix to narrow a scan).
    """
    out = []
    for lv in flt.split("/"):
        if lv == "+" or lv == "#":
            break
        out.append(lv)
    else:
        return flt
    return "/".join(out)
