"""The Spark reader's column-wise Arrow conversion agrees with the SDK's per-record view
(`Record.mqtt`, `Record.msg_id`) for every kind of props a record can carry."""
import datetime as dt

from lmqtt.store import protocol as W
from lmqtt.store.client.consumer import _records
from lmqtt.store.props import encode_fields
from lmqtt.store.spark.source import COLUMNS, arrow_batch


def test_arrow_batch_matches_the_sdk_record_view():
    props = [b"",                                                        # SDK default: QoS 0
             encode_fields(1, True, "dev-1"),
             encode_fields(2, False, "dev-2", content_type="application/json",
                           user_properties=[("a", "1"), ("b", "2"), ("a", "3")]),   # map: last wins
             b"\x07foreign"]                                             # not our format: QoS 0
    recs = []
    for i in range(40):
        p = props[i % len(props)]
        recs.append((100 + i, 5000 + 77 * i, 1_700_000_000_000 + i, 1_700_000_000_500 + i, 0,
                     f"t/{i % 3}", ("k",) if i % 2 else (), p, bytes([i]) * i))
    body = W.encode_messages({"next_offset": 140}, [_Rec(*r) for r in recs])
    header, raw = W.decode_messages(body)
    batch = arrow_batch("t:0", "ABCD", raw).to_pylist()
    _h, sdk = _records("ABCD", body)
    assert [c for c in COLUMNS] == list(batch[0])
    for row, r in zip(batch, sdk, strict=True):
        m = r.mqtt
        assert row["topic"] == r.topic and row["payload"] == r.body and row["offset"] == r.queue_offset
        assert (row["qos"], row["retain"], row["client_id"], row["content_type"]) == \
            (m.qos, m.retain, m.client_id, m.content_type)
        assert dict(row["user_properties"]) == dict(m.user_properties)
        assert row["msg_id"] == r.msg_id and row["queue"] == "t:0"
        assert row["born_ts"] == dt.datetime.fromtimestamp(r.born_ts / 1000, dt.timezone.utc)
        assert row["store_ts"] == dt.datetime.fromtimestamp(r.store_ts / 1000, dt.timezone.utc)
    assert arrow_batch("t:0", "ABCD", []).num_rows == 0


class _Rec:
    """The attributes `protocol.encode_messages` reads from a stored message."""

    def __init__(self, qo, po, born, st, qid, topic, keys, props, body):
        self.queue_offset, self.phys_offset, self.born_ts, self.store_ts = qo, po, born, st
        self.queue_id, self.topic, self.keys, self.props, self.body = qid, topic, keys, props, body
