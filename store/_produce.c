/* lmqtt.store._produce: the PRODUCE body's per-message loops in C. store/produce.py holds the
 * Python reference of each and binds these when built (tests/store/test_produce_accel.py compares
 * them on arbitrary input; tests/fuzz/fuzz_produce.py fuzzes the decoder against its reference).
 *
 * Why: under `serve --workers 2` (and `lmqtt store` fed by gateways or the SDK) every message
 * crosses this body twice: a gateway packs its batch into a PRODUCE (a tuple per message, then a
 * struct.pack and five parts per message: ~0.4 us), the store unpacks it into Messages (a slice,
 * a dict lookup and eight attribute stores per message in Python: ~0.6-0.8 us) and answers a
 * PRODUCED built per run of records (~0.17 us per record when each record is its own run, as in a
 * fan-in of many topics). py-spy of the store under `bench external --brokers lmqtt-workers` put
 * the decode and the answer at ~16 % of its main thread.
 *
 *   configure(layout) must succeed first (store/produce.py calls it at import with its
 *   `C_LAYOUT`): "msg_head_format" (store/protocol.py MSG_HEAD, ">HHHIIQ") and
 *   "produce_head_format" (PRODUCE_HEAD, ">QI"), checked against the offsets read and written
 *   here; "message" (store/message.py Message: its eight slots are read and written directly),
 *   "dispatch_request" (DispatchRequest, whose phys_offset and queue_offset produced_body reads by
 *   position, checked by name), "protocol_error" and "e_bad_frame" (what a bad body raises).
 *   Until then every function raises RuntimeError.
 *
 *   produce_messages(body: bytes, route, now) -> (producer id, seq, [Message])
 *       as store/produce.py `produce_messages_py`: items sharing topic, keys and props share their
 *       decoded objects; `route(topic)` called once per distinct topic (None: no dispatch queues);
 *       a Message's born_ts is `now` (the object) when the item's is 0. The same ProtocolError
 *       (code and message) on the same malformed bodies; an exception raised by `route` propagates.
 *
 *   produced_body(sizes, starts, runs) -> PRODUCED body
 *       from the columns of one append (store/message.py chunk: record sizes, each run's first
 *       record index, each run's first DispatchRequest), as `produced_body_py`.
 *
 *   encode_messages(messages, limit=0) -> the packed messages of a PRODUCE body, or None
 *       as protocol.encode_messages_for_produce over (topic, body, keys, props, queue_id, born_ts)
 *       of each Message (read from its slots). None when a message is not a Message, a field is
 *       not of its plain type and range (str topic and keys, bytes body and props, lengths that fit
 *       the head), or its topic, props and body bytes together pass `limit` (0: no limit): the
 *       caller then runs its own checks and the reference, which packs or raises as it always did.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

#include "_layout.h"

#define READS "this codec reads"

/* store/protocol.py MSG_HEAD: topic len, keys len, props len, body len, queue id, born ts */
enum { M_TL = 0, M_KL = 2, M_PL = 4, M_BL = 6, M_QID = 10, M_BORN = 14, M_END = 22 };
static const field_t msg_head_fields[] = {{"topic_len", M_TL, 2}, {"keys_len", M_KL, 2}, {"props_len", M_PL, 2},
                                          {"body_len", M_BL, 4}, {"queue_id", M_QID, 4}, {"born_ts", M_BORN, 8}};
/* store/protocol.py PRODUCE_HEAD: sequence, message count */
enum { P_SEQ = 0, P_COUNT = 8, P_END = 12 };
static const field_t produce_head_fields[] = {{"seq", P_SEQ, 8}, {"count", P_COUNT, 4}};
/* DispatchRequest positions produced_body reads (store/message.py DR_PHYS, DR_QUEUE_OFFSET) */
enum { DR_PHYS_AT = 0, DR_QOFF_AT = 4 };

static int configured = 0;
static PyTypeObject *Msg_type;
static PyObject *ProtoErr;
static long bad_frame_code;
static Py_ssize_t off_topic, off_body, off_qid, off_flags, off_props, off_keys, off_born, off_dq;
static PyObject *nul_str;          /* "\x00": the keys' separator in a PRODUCE item */

static int not_configured(void) {
    if (configured) return 0;
    PyErr_SetString(PyExc_RuntimeError, "lmqtt.store._produce.configure() was not called or failed "
                    "(store/produce.py configures it at import)");
    return -1;
}

static inline uint16_t be16(const unsigned char *p) { return (uint16_t)((p[0] << 8) | p[1]); }
static inline uint32_t be32(const unsigned char *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}
static inline uint64_t be64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v = (v << 8) | p[i];
    return v;
}
static inline void put16(unsigned char *p, uint32_t v) { p[0] = (unsigned char)(v >> 8); p[1] = (unsigned char)v; }
static inline void put32(unsigned char *p, uint32_t v) {
    for (int i = 3; i >= 0; i--) { p[i] = (unsigned char)v; v >>= 8; }
}
static inline void put64(unsigned char *p, uint64_t v) {
    for (int i = 7; i >= 0; i--) { p[i] = (unsigned char)v; v >>= 8; }
}

#define SLOT(o, off) (*(PyObject **)((char *)(o) + (off)))

/* raise ProtocolError(E_BAD_FRAME, msg) (msg: a str object, stolen) */
static PyObject *bad_frame(PyObject *msg) {
    if (msg == NULL) return NULL;
    PyObject *e = PyObject_CallFunction(ProtoErr, "lO", bad_frame_code, msg);
    Py_DECREF(msg);
    if (e != NULL) {
        PyErr_SetObject((PyObject *)Py_TYPE(e), e);
        Py_DECREF(e);
    }
    return NULL;
}

static PyObject *truncated(void) { return bad_frame(PyUnicode_FromString("PRODUCE body truncated")); }

/* a UnicodeDecodeError of ours becomes the reference's ProtocolError; anything else propagates */
static PyObject *not_utf8(void) {
    if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) return NULL;
    PyErr_Clear();
    return bad_frame(PyUnicode_FromString("PRODUCE topic/key/producer id is not UTF-8"));
}

/* a decoded item's shared parts: (topic, keys, props, dispatch queues), as the reference's `shapes` */
static PyObject *new_shape(const char *key, Py_ssize_t tl, Py_ssize_t kl, Py_ssize_t pl, PyObject *route,
                           PyObject *routes) {
    PyObject *topic = PyUnicode_DecodeUTF8(key, tl, NULL);
    if (topic == NULL) return not_utf8();
    PyObject *keys;
    if (kl) {
        PyObject *s = PyUnicode_DecodeUTF8(key + tl, kl, NULL);
        if (s == NULL) {
            Py_DECREF(topic);
            return not_utf8();
        }
        PyObject *parts = PyUnicode_Split(s, nul_str, -1);
        Py_DECREF(s);
        keys = parts ? PyList_AsTuple(parts) : NULL;
        Py_XDECREF(parts);
    } else {
        keys = PyTuple_New(0);
    }
    PyObject *props = keys ? PyBytes_FromStringAndSize(key + tl + kl, pl) : NULL;
    PyObject *dq = NULL;
    if (props != NULL) {
        dq = PyDict_GetItemWithError(routes, topic);
        if (dq != NULL) {
            Py_INCREF(dq);
        } else if (!PyErr_Occurred()) {
            if (route == Py_None) {
                dq = PyTuple_New(0);
            } else {
                PyObject *r = PyObject_CallOneArg(route, topic);
                dq = r ? PySequence_Tuple(r) : NULL;
                Py_XDECREF(r);
            }
            if (dq != NULL && PyDict_SetItem(routes, topic, dq) < 0) Py_CLEAR(dq);
        }
    }
    if (dq == NULL) {
        Py_DECREF(topic);
        Py_XDECREF(keys);
        Py_XDECREF(props);
        return NULL;
    }
    PyObject *shape = PyTuple_New(4);
    if (shape == NULL) {
        Py_DECREF(topic);
        Py_DECREF(keys);
        Py_DECREF(props);
        Py_DECREF(dq);
        return NULL;
    }
    PyTuple_SET_ITEM(shape, 0, topic);
    PyTuple_SET_ITEM(shape, 1, keys);
    PyTuple_SET_ITEM(shape, 2, props);
    PyTuple_SET_ITEM(shape, 3, dq);
    return shape;
}

static PyObject *produce_messages(PyObject *self, PyObject *args) {
    PyObject *body, *route, *now;
    if (!PyArg_ParseTuple(args, "O!OO", &PyBytes_Type, &body, &route, &now)) return NULL;
    if (not_configured() < 0) return NULL;
    const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(body);
    Py_ssize_t n = PyBytes_GET_SIZE(body);
    if (n < 2) return truncated();
    Py_ssize_t pos = 2 + (Py_ssize_t)be16(p);
    /* the reference decodes body[2:pos] (cut at the end) before it reads the head after it */
    PyObject *pid = PyUnicode_DecodeUTF8((const char *)p + 2, (pos < n ? pos : n) - 2, NULL);
    if (pid == NULL) return not_utf8();
    if (pos + P_END > n) {
        Py_DECREF(pid);
        return truncated();
    }
    uint64_t seq = be64(p + pos + P_SEQ);
    uint32_t count = be32(p + pos + P_COUNT);
    pos += P_END;
    PyObject *out = PyList_New(0);
    PyObject *shapes = PyDict_New();
    PyObject *routes = PyDict_New();
    PyObject *shape = NULL;         /* the last item's (borrowed from shapes) */
    const unsigned char *shape_key = NULL;
    Py_ssize_t shape_len = -1, shape_tl = -1, shape_kl = -1;
    if (out == NULL || shapes == NULL || routes == NULL) goto fail;
    for (uint32_t c = 0; c < count; c++) {
        if (pos + M_END > n) {
            truncated();
            goto fail;
        }
        const unsigned char *h = p + pos;
        Py_ssize_t tl = be16(h + M_TL), kl = be16(h + M_KL), pl = be16(h + M_PL), bl = be32(h + M_BL);
        uint32_t qid = be32(h + M_QID);
        uint64_t born = be64(h + M_BORN);
        pos += M_END;
        Py_ssize_t meta_end = pos + tl + kl + pl, end = meta_end + bl;
        if (end > n) {
            bad_frame(PyUnicode_FromString("PRODUCE body truncated inside a message"));
            goto fail;
        }
        /* an item's shape is its topic, keys and props bytes AND where they split: "a/b" with props
         * b"c" and "a/bc" without are two shapes (the dict key: the two lengths, then the bytes) */
        Py_ssize_t klen = meta_end - pos;
        if (shape == NULL || klen != shape_len || tl != shape_tl || kl != shape_kl ||
            memcmp(shape_key, p + pos, (size_t)klen) != 0) {
            PyObject *key = PyBytes_FromStringAndSize(NULL, 4 + klen);
            if (key == NULL) goto fail;
            unsigned char *kb = (unsigned char *)PyBytes_AS_STRING(key);
            put16(kb, (uint32_t)tl);
            put16(kb + 2, (uint32_t)kl);
            memcpy(kb + 4, p + pos, (size_t)klen);
            shape = PyDict_GetItemWithError(shapes, key);
            if (shape == NULL) {
                if (PyErr_Occurred() ||
                    (shape = new_shape((const char *)p + pos, tl, kl, pl, route, routes)) == NULL) {
                    Py_DECREF(key);
                    goto fail;
                }
                int rc = PyDict_SetItem(shapes, key, shape);
                Py_DECREF(shape);       /* the dict holds it */
                if (rc < 0) {
                    Py_DECREF(key);
                    shape = NULL;
                    goto fail;
                }
            }
            Py_DECREF(key);
            shape_key = p + pos;
            shape_len = klen;
            shape_tl = tl;
            shape_kl = kl;
        }
        PyObject *m = Msg_type->tp_alloc(Msg_type, 0);
        if (m == NULL) goto fail;
        PyObject *b = PyBytes_FromStringAndSize((const char *)p + meta_end, bl);
        PyObject *q = PyLong_FromUnsignedLong(qid);
        PyObject *bt = born ? PyLong_FromUnsignedLongLong(born) : Py_NewRef(now);
        if (b == NULL || q == NULL || bt == NULL) {
            Py_XDECREF(b);
            Py_XDECREF(q);
            Py_XDECREF(bt);
            Py_DECREF(m);
            goto fail;
        }
        SLOT(m, off_topic) = Py_NewRef(PyTuple_GET_ITEM(shape, 0));
        SLOT(m, off_body) = b;
        SLOT(m, off_qid) = q;
        SLOT(m, off_flags) = PyLong_FromLong(0);    /* a small int: cannot fail */
        SLOT(m, off_props) = Py_NewRef(PyTuple_GET_ITEM(shape, 2));
        SLOT(m, off_keys) = Py_NewRef(PyTuple_GET_ITEM(shape, 1));
        SLOT(m, off_born) = bt;
        SLOT(m, off_dq) = Py_NewRef(PyTuple_GET_ITEM(shape, 3));
        int rc = PyList_Append(out, m);
        Py_DECREF(m);
        if (rc < 0) goto fail;
        pos = end;
    }
    if (pos != n) {
        bad_frame(PyUnicode_FromFormat("PRODUCE body has %zd bytes after its %lu messages", n - pos,
                                       (unsigned long)count));
        goto fail;
    }
    Py_DECREF(shapes);
    Py_DECREF(routes);
    PyObject *s = PyLong_FromUnsignedLongLong(seq);
    if (s == NULL) {
        Py_DECREF(pid);
        Py_DECREF(out);
        return NULL;
    }
    PyObject *res = PyTuple_Pack(3, pid, s, out);
    Py_DECREF(pid);
    Py_DECREF(s);
    Py_DECREF(out);
    return res;
fail:
    Py_DECREF(pid);
    Py_XDECREF(out);
    Py_XDECREF(shapes);
    Py_XDECREF(routes);
    return NULL;
}

/* an index from a list of ints, checked to lie in [lo, hi]; -1 with an error set otherwise */
static Py_ssize_t index_in(PyObject *list, Py_ssize_t i, Py_ssize_t lo, Py_ssize_t hi) {
    Py_ssize_t v = PyLong_AsSsize_t(PyList_GET_ITEM(list, i));
    if (v == -1 && PyErr_Occurred()) return -1;
    if (v < lo || v > hi) {
        PyErr_Format(PyExc_ValueError, "produced_body: run start %zd is outside [%zd, %zd]", v, lo, hi);
        return -1;
    }
    return v;
}

static PyObject *produced_body(PyObject *self, PyObject *args) {
    PyObject *sizes, *starts, *runs;
    if (!PyArg_ParseTuple(args, "O!O!O!", &PyList_Type, &sizes, &PyList_Type, &starts, &PyList_Type, &runs))
        return NULL;
    if (not_configured() < 0) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(sizes), nr = PyList_GET_SIZE(runs);
    if (PyList_GET_SIZE(starts) < nr) {
        PyErr_SetString(PyExc_ValueError, "produced_body: fewer run starts than runs");
        return NULL;
    }
    if (n > (PY_SSIZE_T_MAX - 4) / 16) return PyErr_NoMemory();
    PyObject *out = PyBytes_FromStringAndSize(NULL, 4 + 16 * n);
    if (out == NULL) return NULL;
    unsigned char *o = (unsigned char *)PyBytes_AS_STRING(out);
    memset(o, 0, (size_t)(4 + 16 * n));
    put32(o, (uint32_t)n);
    o += 4;
    Py_ssize_t prev = 0;
    for (Py_ssize_t k = 0; k < nr; k++) {
        PyObject *r = PyList_GET_ITEM(runs, k);
        if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) <= DR_QOFF_AT) {
            PyErr_SetString(PyExc_TypeError, "produced_body: a run is not a DispatchRequest");
            goto fail;
        }
        Py_ssize_t i0 = index_in(starts, k, prev, n);
        if (i0 < 0) goto fail;
        Py_ssize_t i1 = k + 1 < nr ? index_in(starts, k + 1, i0, n) : n;
        if (i1 < 0) goto fail;
        prev = i0;
        uint64_t phys = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(r, DR_PHYS_AT));
        if (phys == (uint64_t)-1 && PyErr_Occurred()) goto fail;
        uint64_t qoff = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(r, DR_QOFF_AT));
        if (qoff == (uint64_t)-1 && PyErr_Occurred()) goto fail;
        for (Py_ssize_t i = i0; i < i1; i++) {
            if (i > i0) {
                uint64_t sz = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(sizes, i - 1));
                if (sz == (uint64_t)-1 && PyErr_Occurred()) goto fail;
                if (phys > UINT64_MAX - sz || qoff == UINT64_MAX) {
                    PyErr_SetString(PyExc_OverflowError, "produced_body: an offset passes 2**64");
                    goto fail;
                }
                phys += sz;
                qoff += 1;
            }
            put64(o + 16 * i, phys);
            put64(o + 16 * i + 8, qoff);
        }
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

/* one message's fields for encode_messages, read from its slots (borrowed: the message holds them) */
typedef struct {
    const char *topic;
    Py_ssize_t tl, kl, pl, bl;
    PyObject *keys, *props, *body;
    uint32_t qid;
    uint64_t born;
} item_t;

/* 1: `m` is a Message of the plain shape, its fields in `it`; 0: not (the caller's reference packs
 * it); -1: an error other than a field out of shape */
static int read_item(PyObject *m, item_t *it, unsigned long long limit) {
    if (!PyObject_TypeCheck(m, Msg_type)) return 0;
    PyObject *topic = SLOT(m, off_topic), *body = SLOT(m, off_body), *keys = SLOT(m, off_keys),
             *props = SLOT(m, off_props), *qid = SLOT(m, off_qid), *born = SLOT(m, off_born);
    if (topic == NULL || body == NULL || keys == NULL || props == NULL || qid == NULL || born == NULL) return 0;
    if (!PyUnicode_CheckExact(topic) || !PyBytes_CheckExact(body) || !PyTuple_CheckExact(keys) ||
        !PyBytes_CheckExact(props) || !PyLong_CheckExact(qid) || !PyLong_CheckExact(born))
        return 0;
    it->topic = PyUnicode_AsUTF8AndSize(topic, &it->tl);
    if (it->topic == NULL) {
        PyErr_Clear();          /* a lone surrogate: the reference raises its own error */
        return 0;
    }
    Py_ssize_t nk = PyTuple_GET_SIZE(keys), kl = nk ? nk - 1 : 0;
    for (Py_ssize_t i = 0; i < nk; i++) {
        PyObject *k = PyTuple_GET_ITEM(keys, i);
        Py_ssize_t len;
        if (!PyUnicode_CheckExact(k) || PyUnicode_AsUTF8AndSize(k, &len) == NULL) {
            PyErr_Clear();
            return 0;
        }
        kl += len;
    }
    unsigned long long q = PyLong_AsUnsignedLongLong(qid);
    if (q == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    unsigned long long b = PyLong_AsUnsignedLongLong(born);
    if (b == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    it->kl = kl;
    it->pl = PyBytes_GET_SIZE(props);
    it->bl = PyBytes_GET_SIZE(body);
    if (it->tl > 0xFFFF || kl > 0xFFFF || it->pl > 0xFFFF || (uint64_t)it->bl > 0xFFFFFFFFu || q > 0xFFFFFFFFu)
        return 0;
    if (limit && (unsigned long long)(it->tl + it->pl + it->bl) > limit) return 0;
    it->qid = (uint32_t)q;
    it->born = (uint64_t)b;
    it->keys = keys;
    it->props = props;
    it->body = body;
    return 1;
}

static PyObject *encode_messages(PyObject *self, PyObject *args) {
    PyObject *messages;
    unsigned long long limit = 0;
    if (!PyArg_ParseTuple(args, "O|K", &messages, &limit)) return NULL;
    if (not_configured() < 0) return NULL;
    PyObject *seq = PySequence_Fast(messages, "encode_messages: messages must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    item_t *items = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(item_t));
    if (items == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    PyObject *out = NULL;
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int ok = read_item(PySequence_Fast_GET_ITEM(seq, i), &items[i], limit);
        if (ok <= 0) {
            if (ok == 0) out = Py_NewRef(Py_None);
            goto done;
        }
        total += M_END + items[i].tl + items[i].kl + items[i].pl + items[i].bl;
    }
    out = PyBytes_FromStringAndSize(NULL, total);
    if (out == NULL) goto done;
    unsigned char *o = (unsigned char *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        item_t *it = &items[i];
        put16(o + M_TL, (uint32_t)it->tl);
        put16(o + M_KL, (uint32_t)it->kl);
        put16(o + M_PL, (uint32_t)it->pl);
        put32(o + M_BL, (uint32_t)it->bl);
        put32(o + M_QID, it->qid);
        put64(o + M_BORN, it->born);
        o += M_END;
        memcpy(o, it->topic, (size_t)it->tl);
        o += it->tl;
        Py_ssize_t nk = PyTuple_GET_SIZE(it->keys);
        for (Py_ssize_t k = 0; k < nk; k++) {
            Py_ssize_t len;
            const char *s = PyUnicode_AsUTF8AndSize(PyTuple_GET_ITEM(it->keys, k), &len);   /* cached above */
            if (k) *o++ = 0;
            memcpy(o, s, (size_t)len);
            o += len;
        }
        memcpy(o, PyBytes_AS_STRING(it->props), (size_t)it->pl);
        o += it->pl;
        memcpy(o, PyBytes_AS_STRING(it->body), (size_t)it->bl);
        o += it->bl;
    }
done:
    PyMem_Free(items);
    Py_DECREF(seq);
    return out;
}

static const char *const dr_read[] = {"phys_offset", "size", "topic", "queue_id", "queue_offset"};

static PyObject *configure(PyObject *self, PyObject *args) {
    PyObject *layout;
    long long size, code;
    if (!PyArg_ParseTuple(args, "O!", &PyDict_Type, &layout)) return NULL;
    configured = 0;
    const char *mf = layout_str(layout, "msg_head_format");
    if (mf == NULL || check_format("PRODUCE message head", mf, '>', msg_head_fields, N_FIELDS(msg_head_fields), 1,
                                   &size, READS) < 0)
        return NULL;
    const char *pf = layout_str(layout, "produce_head_format");
    if (pf == NULL || check_format("PRODUCE head", pf, '>', produce_head_fields, N_FIELDS(produce_head_fields), 1,
                                   &size, READS) < 0)
        return NULL;
    PyObject *mt = PyDict_GetItemString(layout, "message");
    PyObject *pe = PyDict_GetItemString(layout, "protocol_error");
    PyObject *dr = PyDict_GetItemString(layout, "dispatch_request");
    if (mt == NULL || !PyType_Check(mt) || pe == NULL || !PyExceptionClass_Check(pe) || dr == NULL ||
        !PyType_Check(dr)) {
        PyErr_SetString(PyExc_ValueError, "configure: layout needs message (a type), protocol_error (an "
                        "exception class) and dispatch_request (a type)");
        return NULL;
    }
    if (layout_int(layout, "e_bad_frame", &code) < 0) return NULL;
    PyObject *fields = PyObject_GetAttrString(dr, "_fields");
    if (fields == NULL) return NULL;
    int ok = PyTuple_Check(fields) && PyTuple_GET_SIZE(fields) > DR_QOFF_AT;
    for (Py_ssize_t i = 0; ok && i <= DR_QOFF_AT; i++)
        ok = PyUnicode_Check(PyTuple_GET_ITEM(fields, i)) &&
             PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(fields, i), dr_read[i]) == 0;
    Py_DECREF(fields);
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "configure: DispatchRequest does not start with phys_offset, size, "
                        "topic, queue_id, queue_offset, the positions produced_body reads");
        return NULL;
    }
    PyTypeObject *tp = (PyTypeObject *)mt;
    const char *names[] = {"topic", "body", "queue_id", "flags", "props", "keys", "born_ts", "dispatch_queues"};
    Py_ssize_t *offs[] = {&off_topic, &off_body, &off_qid, &off_flags, &off_props, &off_keys, &off_born, &off_dq};
    for (int i = 0; i < 8; i++) {
        *offs[i] = slot_offset(tp, names[i]);
        if (*offs[i] < 0) {
            PyErr_Format(PyExc_ValueError, "configure: %s has no slot %s (an object field), which this codec "
                         "reads and writes", tp->tp_name, names[i]);
            return NULL;
        }
    }
    if (nul_str == NULL && (nul_str = PyUnicode_FromStringAndSize("\0", 1)) == NULL) return NULL;
    Py_XSETREF(Msg_type, (PyTypeObject *)Py_NewRef(mt));
    Py_XSETREF(ProtoErr, Py_NewRef(pe));
    bad_frame_code = (long)code;
    configured = 1;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS, "configure(layout): the formats and types this codec reads (module doc)"},
    {"produce_messages", produce_messages, METH_VARARGS,
     "produce_messages(body, route, now) -> (producer id, seq, [Message]) (store/produce.py)"},
    {"produced_body", produced_body, METH_VARARGS,
     "produced_body(sizes, starts, runs) -> the PRODUCED body of one append's columns (store/produce.py)"},
    {"encode_messages", encode_messages, METH_VARARGS,
     "encode_messages(messages, limit=0) -> packed PRODUCE messages, or None for the caller's checks and the "
     "reference (store/produce.py)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_produce",
    "C loops of store/produce.py's PRODUCE codec (Python references beside them there)", -1, methods};

PyMODINIT_FUNC PyInit__produce(void) { return PyModule_Create(&module); }
