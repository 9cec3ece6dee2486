"""Which store group owns each first-level topic, for a gateway over several groups (docs/groups.md).

The rule is the SDK's (store/client/groups.py): the first group of the list is the directory; a
first-level topic's owner is recorded there once (`topic_group_claim`, put-if-absent, replicated
before it answers) and never changes, so a gateway asks once per first level and keeps the answer
for good. A first level never claimed is claimed for the group rendezvous hashing picks among the
groups' names, so every gateway and SDK client agrees whoever asks first.

On the event loop nothing may block: `owner(first)` is an `Answer` - done at once for a known
first level, else completed by the directory's reply. Claims of one first level asked while one is
in flight share it (one request), and a failed claim is forgotten (asked again next time).
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING

from lmqtt.gateway.storage.facades import Answer
from lmqtt.gateway.storage.remote_metadata import ask_raw
from lmqtt.store import protocol as W
from lmqtt.store.client.groups import filter_first_level, first_level, owner_index, rendezvous

if TYPE_CHECKING:  # pragma: no cover
    from lmqtt.gateway.storage.store_link import LoopConnection

__all__ = ["TopicOwners", "first_level", "filter_first_level", "part_name", "split_part", "spanning"]

# A filter whose first level is a wildcard matches topics of every group: a subscription to it is
# one queue per group, all named by the filter in their stores. In the gateway (a session's
# cursors and offsets, the delivery engine's readers) the first group's part keeps the filter's
# own name (a session that subscribed through one group resumes on it) and group i's is the
# filter, NUL, i: NUL is not allowed in an MQTT topic or filter (MQTT-1.5.4-2), so no client's
# filter can take that name. The grouped facades turn a part name back into (filter, group)
# before any store sees it.
PART = "\x00"


def spanning(name: str) -> bool:
    """Whether `name` is a filter (or a queue named by one) matching topics of every group."""
    return PART not in name and filter_first_level(name) is None


def part_name(flt: str, i: int) -> str:
    """Group `i`'s part of spanning filter `flt` as the gateway names it."""
    return flt if i == 0 else f"{flt}{PART}{i}"


def split_part(name: str) -> tuple[str, int] | None:
    """(filter, group index) of a part name of group 1 or later; None for any other name."""
    if PART not in name:
        return None
    flt, _, i = name.rpartition(PART)
    return flt, int(i)


class TopicOwners:
    """`names`: each group's name in list order (HELLO_OK `group`, else its address);
    `directory`: the first group's link; `address`: the `--store` list, for error messages."""

    def __init__(self, directory: "LoopConnection", names: list[str], addresses: list[str], address: str) -> None:
        self.directory = directory
        self.names = names
        self.addresses = addresses
        self.address = address
        self._owners: dict[str, int] = {}
        self._asking: dict[str, Answer[int]] = {}
        self.claims = 0               # requests sent to the directory (one per new first level)

    def owned(self) -> dict[str, int]:
        """Every first level whose owner this gateway knows."""
        return self._owners

    def known(self, first: str) -> int | None:
        """The owner's index when this gateway knows it already, else None."""
        return self._owners.get(first)

    def owner(self, first: str) -> Answer[int]:
        """The index of the group owning the first-level topic `first`."""
        at = self._owners.get(first)
        if at is not None:
            return Answer.of(at)
        asking = self._asking.get(first)
        if asking is not None:
            return asking
        self.claims += 1
        choice = self.names[rendezvous(first, self.names)]

        def decode(op: int, body: bytes) -> int:
            if op != W.OP_RESULT:
                raise ValueError(f"topic_group_claim answered opcode {op:#x}")
            return owner_index(json.loads(body)["group"], self.names, first, self.addresses, self.address)
        out: Answer[int] = ask_raw(self.directory, "topic_group_claim", {"topic": first, "group": choice}, decode)
        self._asking[first] = out

        def done(a: Answer[int]) -> None:
            self._asking.pop(first, None)
            if a.exception() is None:
                self._owners[first] = a.result()
        out.add_done_callback(done)
        return out

    def settled(self) -> Answer[None]:
        """Done once every claim asked so far is answered: a call that spans groups waits for it,
        so it reaches the store after the calls made before it that waited for a claim (a read
        after a write sees it, as over one link)."""
        return Answer.all_in(list(self._asking.values()))

    def of_topic(self, topic: str) -> Answer[int]:
        return self.owner(first_level(topic))

    def of_filter(self, flt: str) -> Answer[int] | None:
        """The owner of the one first level `flt` can match; None when its first level is a
        wildcard (it matches topics of every group)."""
        first = filter_first_level(flt)
        return None if first is None else self.owner(first)
