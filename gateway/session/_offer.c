/* lmqtt.gateway.session._offer: the session machine's `offer` (gateway/session/outbound.py) in C,
 * for its steady state: one queue's batch of pulled messages to a session that reads the queue
 * through one plain subscription.
 *
 * Why: `offer` is the delivery side's per-message loop, and with the encoding of each message's
 * PUBLISH (`PublishTemplate.encode` and `_parts`) and the connection's `write` per frame it was
 * the largest piece of the broker's per-message Python: ~26 % of lmqtt serve's CPU in a QoS 0
 * fan-in, ~15 % at 5,000 msg/s over 50 QoS 1 pairs (cProfile, tottime of the calls it makes).
 * Here the loop reads the messages' slots, encodes the PUBLISH variants into each message's
 * `encodings` exactly as `PublishTemplate._parts` does (MQTT 3.1.1; MQTT 5's property block is
 * asked of the message), builds each `InFlight` tuple, and hands the batch's frames to `write`
 * joined, once.
 *
 * The Python `offer` is the reference and keeps everything this does not take: the caller tries
 * this only without an ACL read rule, MQTT 5 per-subscriber parts, a client Maximum Packet Size or
 * overlapping subscriptions; this returns None (nothing done) when a message is not an
 * `OutboundMessage` or carries a Message Expiry Interval, and the reference runs. Packet ids are
 * taken with the machine's own `_take_ids` and the offer is closed with its `_close_offer`, so
 * the allocator, the cursor and the counts have one implementation. tests/session run with this
 * module on and off (LMQTT_PURE_PYTHON), and tests/session/test_offer_accel.py compares the two
 * on random sessions and batches (frames written, window, cursor, counts, flags).
 *
 *   configure(OutboundMessage, InFlight, OVER, QOS2_SENT, WAIT_ACK)
 *   offer(session, q, messages, next_offset, write, tally, budget) -> flags, or None
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

static PyTypeObject *outbound_type = NULL, *inflight_type = NULL;
static long OVER = 0, QOS2_SENT = 0;
static PyObject *wait_ack = NULL;
static int configured = 0;

/* interned attribute names */
static PyObject *s_cursors, *s_direct, *s_window, *s_receive_max, *s_client_id, *s_version, *s_qos,
    *s_no_local, *s_retain_as_published, *s_inflight, *s_next_offset, *s_queue_offset, *s_record,
    *s_retain, *s_message_expiry_interval, *s_encodings, *s_topic, *s_payload, *s_sent, *s_store_ts,
    *s_take_ids, *s_close_offer, *s_properties_block, *s_parts, *s_empty;

static int intern_all(void) {
#define I(v, s) if (!(v = PyUnicode_InternFromString(s))) return -1;
    I(s_cursors, "cursors") I(s_direct, "direct") I(s_window, "_window") I(s_receive_max, "_receive_max")
    I(s_client_id, "client_id") I(s_version, "version") I(s_qos, "qos") I(s_no_local, "no_local")
    I(s_retain_as_published, "retain_as_published") I(s_inflight, "_inflight") I(s_next_offset, "next_offset")
    I(s_queue_offset, "queue_offset") I(s_record, "record") I(s_retain, "retain")
    I(s_message_expiry_interval, "message_expiry_interval") I(s_encodings, "encodings") I(s_topic, "topic")
    I(s_payload, "payload") I(s_sent, "sent") I(s_store_ts, "store_ts") I(s_take_ids, "_take_ids")
    I(s_close_offer, "_close_offer") I(s_properties_block, "properties_block") I(s_parts, "_parts")
#undef I
    if (!(s_empty = PyBytes_FromStringAndSize("", 0))) return -1;
    return 0;
}

static PyObject *configure(PyObject *self, PyObject *args) {
    PyObject *ob, *inf, *wa;
    long over, q2;
    if (!PyArg_ParseTuple(args, "O!O!llO", &PyType_Type, &ob, &PyType_Type, &inf, &over, &q2, &wa)) return NULL;
    if (!PyType_IsSubtype((PyTypeObject *)inf, &PyTuple_Type)) {
        PyErr_SetString(PyExc_ValueError, "configure: InFlight must be a tuple subclass");
        return NULL;
    }
    if (((PyTypeObject *)inf)->tp_basicsize != PyTuple_Type.tp_basicsize) {
        PyErr_SetString(PyExc_ValueError, "configure: InFlight must add no fields to tuple (__slots__ = ())");
        return NULL;
    }
    Py_XDECREF(outbound_type);
    Py_XDECREF(inflight_type);
    Py_XDECREF(wait_ack);
    Py_INCREF(ob);
    Py_INCREF(inf);
    Py_INCREF(wa);
    outbound_type = (PyTypeObject *)ob;
    inflight_type = (PyTypeObject *)inf;
    wait_ack = wa;
    OVER = over;
    QOS2_SENT = q2;
    configured = 1;
    Py_RETURN_NONE;
}

static inline long as_long(PyObject *o, int *err) {
    long v = PyLong_AsLong(o);
    if (v == -1 && PyErr_Occurred()) *err = 1;
    return v;
}

/* getattr as a C long (-1 and *err on failure) */
static long attr_long(PyObject *o, PyObject *name, int *err) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (!v) { *err = 1; return -1; }
    long r = as_long(v, err);
    Py_DECREF(v);
    return r;
}

static int attr_true(PyObject *o, PyObject *name) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (!v) return -1;
    int r = PyObject_IsTrue(v);
    Py_DECREF(v);
    return r;
}

static void put_varint(unsigned char **p, Py_ssize_t n) {
    do {
        unsigned char b = n & 0x7F;
        n >>= 7;
        *(*p)++ = b | (n ? 0x80 : 0);
    } while (n);
}

static Py_ssize_t varint_len(Py_ssize_t n) {
    return n < 128 ? 1 : n < 16384 ? 2 : n < 2097152 ? 3 : 4;
}

/* PublishTemplate._parts(qos, retain, b"") for MQTT 3.1.1: the QoS 0 packet (bytes), or (the bytes
 * before the packet id, the payload) */
static PyObject *parts_v4(PyObject *it, int qos, int retain) {
    PyObject *topic = PyObject_GetAttr(it, s_topic);
    if (!topic) return NULL;
    PyObject *payload = PyObject_GetAttr(it, s_payload);
    if (!payload) { Py_DECREF(topic); return NULL; }
    Py_ssize_t tlen;
    const char *t = PyUnicode_AsUTF8AndSize(topic, &tlen);
    PyObject *out = NULL;
    Py_buffer pb;
    if (!t || PyObject_GetBuffer(payload, &pb, PyBUF_SIMPLE) < 0) goto done;
    if (tlen > 0xFFFF) {
        PyErr_SetString(PyExc_ValueError, "topic longer than 65535 bytes");
        PyBuffer_Release(&pb);
        goto done;
    }
    unsigned char first = 0x30 | (qos << 1) | (retain ? 1 : 0);
    if (qos) {
        Py_ssize_t rl = 2 + tlen + 2 + pb.len;
        PyObject *head = PyBytes_FromStringAndSize(NULL, 1 + varint_len(rl) + 2 + tlen);
        if (head) {
            unsigned char *p = (unsigned char *)PyBytes_AS_STRING(head);
            *p++ = first;
            put_varint(&p, rl);
            *p++ = (unsigned char)(tlen >> 8);
            *p++ = (unsigned char)tlen;
            memcpy(p, t, tlen);
            out = PyTuple_Pack(2, head, payload);
            Py_DECREF(head);
        }
    } else {
        Py_ssize_t rl = 2 + tlen + pb.len;
        out = PyBytes_FromStringAndSize(NULL, 1 + varint_len(rl) + rl);
        if (out) {
            unsigned char *p = (unsigned char *)PyBytes_AS_STRING(out);
            *p++ = first;
            put_varint(&p, rl);
            *p++ = (unsigned char)(tlen >> 8);
            *p++ = (unsigned char)tlen;
            memcpy(p, t, tlen);
            memcpy(p + tlen, pb.buf, pb.len);
        }
    }
    PyBuffer_Release(&pb);
done:
    Py_DECREF(topic);
    Py_DECREF(payload);
    return out;
}

/* PublishTemplate.encode(qos, retain, version, pid) for a message not sent before with DUP: new ref */
static PyObject *encode(PyObject *it, int qos, int retain, int v5, long pid) {
    PyObject *enc = PyObject_GetAttr(it, s_encodings);
    if (!enc) return NULL;
    if (!PyDict_Check(enc)) {
        PyErr_SetString(PyExc_TypeError, "encodings must be a dict");
        Py_DECREF(enc);
        return NULL;
    }
    long key = qos | (retain ? 4 : 0) | (v5 ? 8 : 0);
    PyObject *k = PyLong_FromLong(key);
    if (!k) { Py_DECREF(enc); return NULL; }
    PyObject *t = PyDict_GetItemWithError(enc, k);    /* borrowed */
    if (t) {
        Py_INCREF(t);
    } else {
        if (PyErr_Occurred()) goto fail;
        if (v5) {
            PyObject *props = PyObject_CallMethodNoArgs(it, s_properties_block);
            if (!props) goto fail;
            t = PyObject_CallMethod(it, "_parts", "iOO", qos, retain ? Py_True : Py_False, props);
            Py_DECREF(props);
        } else {
            t = parts_v4(it, qos, retain);
        }
        if (!t || PyDict_SetItem(enc, k, t) < 0) { Py_XDECREF(t); goto fail; }
    }
    Py_DECREF(k);
    Py_DECREF(enc);
    if (qos == 0) return t;
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 2) {
        PyErr_SetString(PyExc_TypeError, "a QoS 1/2 encoding must be (head, tail)");
        Py_DECREF(t);
        return NULL;
    }
    PyObject *head = PyTuple_GET_ITEM(t, 0), *tail = PyTuple_GET_ITEM(t, 1);
    Py_buffer hb, tb;
    if (PyObject_GetBuffer(head, &hb, PyBUF_SIMPLE) < 0) { Py_DECREF(t); return NULL; }
    if (PyObject_GetBuffer(tail, &tb, PyBUF_SIMPLE) < 0) { PyBuffer_Release(&hb); Py_DECREF(t); return NULL; }
    PyObject *out = PyBytes_FromStringAndSize(NULL, hb.len + 2 + tb.len);
    if (out) {
        char *p = PyBytes_AS_STRING(out);
        memcpy(p, hb.buf, hb.len);
        p[hb.len] = (char)(pid >> 8);
        p[hb.len + 1] = (char)pid;
        memcpy(p + hb.len + 2, tb.buf, tb.len);
    }
    PyBuffer_Release(&hb);
    PyBuffer_Release(&tb);
    Py_DECREF(t);
    return out;
fail:
    Py_DECREF(k);
    Py_DECREF(enc);
    return NULL;
}

static PyObject *offer(PyObject *self, PyObject *args) {
    PyObject *s, *q, *messages, *next_offset, *write, *tally;
    long budget;
    if (!PyArg_ParseTuple(args, "OOO!OOOl", &s, &q, &PyList_Type, &messages, &next_offset, &write, &tally, &budget))
        return NULL;
    if (!configured) {
        PyErr_SetString(PyExc_RuntimeError, "_offer is not configured");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(messages);
    /* what the reference keeps: a message of another kind, or with a Message Expiry Interval */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *it = PyList_GET_ITEM(messages, i);
        if (Py_TYPE(it) != outbound_type) Py_RETURN_NONE;
        PyObject *rec = PyObject_GetAttr(it, s_record);
        if (!rec) return NULL;
        PyObject *mei = PyObject_GetAttr(rec, s_message_expiry_interval);
        Py_DECREF(rec);
        if (!mei) return NULL;
        int has = mei != Py_None;
        Py_DECREF(mei);
        if (has) Py_RETURN_NONE;
    }
    int err = 0;
    PyObject *cursors = NULL, *cur = NULL, *direct = NULL, *sub = NULL, *window = NULL, *cid = NULL,
             *inflight = NULL, *ids = NULL, *frames = NULL, *first_ts = NULL, *result = NULL, *items = NULL;
    if (!(cursors = PyObject_GetAttr(s, s_cursors))) goto done;
    if (!(cur = PyObject_GetItem(cursors, q))) goto done;
    if (!(direct = PyObject_GetAttr(s, s_direct))) goto done;
    if (!(sub = PyObject_GetItem(direct, q))) goto done;
    if (!(window = PyObject_GetAttr(s, s_window))) goto done;
    if (!PyDict_Check(window)) { PyErr_SetString(PyExc_TypeError, "_window must be a dict"); goto done; }
    long room = attr_long(s, s_receive_max, &err) - PyDict_GET_SIZE(window);
    long sub_qos = attr_long(sub, s_qos, &err);
    if (err) goto done;
    int no_local = attr_true(sub, s_no_local);
    int rap = attr_true(sub, s_retain_as_published);
    if (no_local < 0 || rap < 0) goto done;
    if (!(cid = PyObject_GetAttr(s, s_client_id))) goto done;
    long version = attr_long(s, s_version, &err);
    if (err) goto done;
    int v5 = version == 5;
    if (!(inflight = PyObject_GetAttr(cur, s_inflight))) goto done;
    long nxt = attr_long(cur, s_next_offset, &err);
    if (err) goto done;
    if (!(frames = PyList_New(0))) goto done;
    long sent0 = 0, sent1 = 0, sent2 = 0, used = 0;
    int complete = 1, over = 0;
    /* the loop reads a tuple of the batch, not the list: the Python it calls (`_take_ids`, an
     * MQTT 5 message's `properties_block`) cannot then free an item borrowed here */
    if (!(items = PyList_AsTuple(messages))) goto done;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(items); i++) {
        PyObject *it = PyTuple_GET_ITEM(items, i);
        long off = attr_long(it, s_queue_offset, &err);
        if (err) goto done;
        if (off < nxt) continue;
        long qos = sub_qos;
        PyObject *rec = PyObject_GetAttr(it, s_record);
        if (!rec) goto done;
        if (no_local) {
            PyObject *rc = PyObject_GetAttr(rec, s_client_id);
            if (!rc) { Py_DECREF(rec); goto done; }
            int same = PyObject_RichCompareBool(rc, cid, Py_EQ);
            Py_DECREF(rc);
            if (same < 0) { Py_DECREF(rec); goto done; }
            if (same) { Py_DECREF(rec); nxt = off + 1; continue; }
        }
        long rq = attr_long(rec, s_qos, &err);
        if (err) { Py_DECREF(rec); goto done; }
        if (rq < qos) qos = rq;
        long pid = 0;
        if (qos) {
            if (room <= 0) { complete = 0; Py_DECREF(rec); break; }
            if (!ids) {
                ids = PyObject_CallMethod(s, "_take_ids", "n", room < n ? (Py_ssize_t)room : n);
                if (!ids) { Py_DECREF(rec); goto done; }
                if (!PyList_Check(ids)) { PyErr_SetString(PyExc_TypeError, "_take_ids must return a list");
                                          Py_DECREF(rec); goto done; }
            }
            if (used >= PyList_GET_SIZE(ids)) { PyErr_SetString(PyExc_RuntimeError, "packet ids exhausted");
                                                Py_DECREF(rec); goto done; }
            pid = as_long(PyList_GET_ITEM(ids, used), &err);
            if (err) { Py_DECREF(rec); goto done; }
        }
        int retain = 0;
        if (rap) {
            retain = attr_true(rec, s_retain);
            if (retain < 0) { Py_DECREF(rec); goto done; }
        }
        PyObject *data = encode(it, (int)qos, retain, v5, pid);
        if (!data) { Py_DECREF(rec); goto done; }
        int was_sent = attr_true(it, s_sent);
        if (was_sent < 0) { Py_DECREF(data); Py_DECREF(rec); goto done; }
        if (!was_sent) {
            if (PyObject_SetAttr(it, s_sent, Py_True) < 0) { Py_DECREF(data); Py_DECREF(rec); goto done; }
            PyObject *ts = PyObject_GetAttr(it, s_store_ts);
            if (!ts) { Py_DECREF(data); Py_DECREF(rec); goto done; }
            int t = PyObject_IsTrue(ts);
            if (t > 0) {
                if (!first_ts && !(first_ts = PyList_New(0))) t = -1;
                if (t > 0 && PyList_Append(first_ts, ts) < 0) t = -1;
            }
            Py_DECREF(ts);
            if (t < 0) { Py_DECREF(data); Py_DECREF(rec); goto done; }
        }
        if (!qos) {
            sent0++;
        } else {
            used++;
            PyObject *inf = inflight_type->tp_alloc(inflight_type, 10);
            PyObject *pidobj = PyLong_FromLong(pid), *qobj = PyLong_FromLong(qos), *offobj = PyLong_FromLong(off);
            if (!inf || !pidobj || !qobj || !offobj) {
                Py_XDECREF(inf); Py_XDECREF(pidobj); Py_XDECREF(qobj); Py_XDECREF(offobj);
                Py_DECREF(data); Py_DECREF(rec); goto done;
            }
            PyObject *rt = retain ? Py_True : Py_False;
            Py_INCREF(pidobj); Py_INCREF(rt); Py_INCREF(q); Py_INCREF(offobj); Py_INCREF(Py_None);
            Py_INCREF(Py_None); Py_INCREF(wait_ack); Py_INCREF(it);
            PyTuple_SET_ITEM(inf, 0, pidobj);
            PyTuple_SET_ITEM(inf, 1, qobj);
            PyTuple_SET_ITEM(inf, 2, rt);
            PyTuple_SET_ITEM(inf, 3, q);
            PyTuple_SET_ITEM(inf, 4, offobj);
            PyTuple_SET_ITEM(inf, 5, Py_None);
            PyTuple_SET_ITEM(inf, 6, Py_None);
            PyTuple_SET_ITEM(inf, 7, wait_ack);
            PyTuple_SET_ITEM(inf, 8, it);
            PyTuple_SET_ITEM(inf, 9, rec);          /* the tuple takes this reference */
            rec = NULL;
            int rc = PyDict_SetItem(window, pidobj, inf);
            Py_DECREF(inf);
            if (rc == 0 && inflight == Py_None) {
                Py_DECREF(inflight);
                inflight = PyDict_New();
                if (!inflight || PyObject_SetAttr(cur, s_inflight, inflight) < 0) rc = -1;
            }
            if (rc == 0) rc = PyObject_SetItem(inflight, offobj, pidobj);
            Py_DECREF(pidobj);
            Py_DECREF(offobj);
            if (rc < 0) { Py_DECREF(data); goto done; }
            room--;
            if (qos == 1) sent1++; else sent2++;
        }
        Py_XDECREF(rec);
        int rc = PyList_Append(frames, data);
        Py_DECREF(data);
        if (rc < 0) goto done;
        nxt = off + 1;
        PyObject *payload = PyObject_GetAttr(it, s_payload);
        if (!payload) goto done;
        Py_ssize_t plen = PyObject_Length(payload);
        Py_DECREF(payload);
        if (plen < 0) goto done;
        budget -= (long)plen;
        if (budget <= 0) { over = 1; break; }
    }
    if (PyList_GET_SIZE(frames)) {
        PyObject *joined;
        if (PyList_GET_SIZE(frames) == 1) {
            joined = PyList_GET_ITEM(frames, 0);
            Py_INCREF(joined);
        } else {
            joined = PyObject_CallMethod(s_empty, "join", "O", frames);
        }
        if (!joined) goto done;
        PyObject *r = PyObject_CallOneArg(write, joined);
        Py_DECREF(joined);
        if (!r) goto done;
        Py_DECREF(r);
    }
    {
        PyObject *r = PyObject_CallMethod(s, "_close_offer", "OlOOOlOlllO", cur, nxt, next_offset,
                                          (complete && !over) ? Py_True : Py_False, ids ? ids : Py_None, used,
                                          tally, sent0, sent1, sent2, first_ts ? first_ts : Py_None);
        if (!r) goto done;
        Py_DECREF(r);
    }
    result = PyLong_FromLong((over ? OVER : 0) | (sent2 ? QOS2_SENT : 0));
done:
    Py_XDECREF(items); Py_XDECREF(cursors); Py_XDECREF(cur); Py_XDECREF(direct); Py_XDECREF(sub); Py_XDECREF(window);
    Py_XDECREF(cid); Py_XDECREF(inflight); Py_XDECREF(ids); Py_XDECREF(frames); Py_XDECREF(first_ts);
    return result;
}

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS, "configure(OutboundMessage, InFlight, OVER, QOS2_SENT, WAIT_ACK)"},
    {"offer", offer, METH_VARARGS, "offer(session, q, messages, next_offset, write, tally, budget) -> flags or None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_offer", NULL, -1, methods};

PyMODINIT_FUNC PyInit__offer(void) {
    if (intern_all() < 0) return NULL;
    return PyModule_Create(&module);
}
