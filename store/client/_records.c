/* lmqtt.store.client._records: the SDK's decode of a raw MESSAGES reply in C (optional accelerator).
 *
 * Why: a pull of 1,024 records of 100 bytes spent ~2 us of client CPU per record in the Python loop
 * (`records.records_raw`: a 15-field struct unpack, four slices, a named tuple and an f-string
 * msg id per record), which held `lmqtt bench sdk` pull at ~250k msg/s with the server at 1.6 us.
 * This does exactly what `records_raw` does, record for record (tests/store/test_fastpath.py
 * compares them on real replies of a store, and on malformed ones); the Python loop stays the
 * reference and the fallback when this does not build or LMQTT_PURE_PYTHON=1 is set
 * (store/accel.py).
 *
 * configure(Record, layout) must succeed first (store/client/consumer.py calls it at import):
 * `Record` is the SDK's named tuple (consumer.Record), whose `_fields` must be the order this loop
 * fills (record_fields below); `layout` is consumer.C_LAYOUT, the record header's struct format,
 * field names and size from store/record.py (HEADER, HEADER_FIELDS, HEADER_SIZE), checked against
 * the fields this loop reads (record_head_fields and F_END in store/_layout.h: compiled in, the
 * layout is only compared with them, nothing is taken from it). A mismatch raises ValueError
 * naming the field, so a layout change on the Python side cannot make this loop build wrong
 * Records; until a configure() succeeds, decode() raises RuntimeError.
 *
 * decode(body, pos, count, ident) -> list of Record
 *
 * `body[pos:]` holds `count` CommitLog records (docs/store.md): the little-endian head (total u32,
 * magic u32, crc u32, queue_id u32, flags u32, queue_offset u64, phys_offset u64, born_ts u64,
 * store_ts u64, tags u64, body_len u32, props_len u32, topic_len u16, keys_len u16, dq_len u16),
 * then topic, keys (NUL-joined), dispatch queues, props, body. Each Record is (topic, body, keys,
 * props, queue_id, queue_offset, offset = phys_offset, born_ts, store_ts, msg_id) with msg_id =
 * ident + 16 upper-case hex digits of phys_offset. Topic and props objects are shared with the
 * previous record when their bytes are equal (one object per run, like the Python loop's
 * per-reply caches give equal values). Raises ValueError for a record that does not fit.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "../_layout.h"

/* The record head this loop reads is store/_layout.h's (F_* offsets, record_head_fields): configure()
 * checks HEADER's format and HEADER_FIELDS against it, and decode() steps by the compiled F_END (the
 * layout's header_size is only checked to equal it). */

/* The Record fields in the order this loop fills the tuple (store/client/consumer.py Record),
 * checked by configure() against Record._fields. */
enum { R_TOPIC, R_BODY, R_KEYS, R_PROPS, R_QUEUE_ID, R_QUEUE_OFFSET, R_OFFSET, R_BORN_TS, R_STORE_TS, R_MSG_ID,
       N_RECORD_FIELDS };
static const char *const record_fields[N_RECORD_FIELDS] = {
    "topic", "body", "keys", "props", "queue_id", "queue_offset", "offset", "born_ts", "store_ts", "msg_id"};

/* set by configure() once the layout is accepted; decode() refuses to run before */
static PyTypeObject *record_type;
/* A Record holds strings, bytes, ints and a tuple of strings: it can never be part of a reference
 * cycle, so the collector has nothing to find in it. A named tuple is a tuple subclass, which the
 * collector never untracks by itself (it does so only for exact tuples), so without this every
 * Record a consumer keeps is scanned at each collection of its generation (as store/_append.c does
 * for the store's StoredMessages). Only when the type adds no __dict__ (a __dict__ could hold anything). */
static int record_untrack;

static uint32_t le32(const unsigned char *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static uint16_t le16(const unsigned char *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static uint64_t le64(const unsigned char *p) { return (uint64_t)le32(p) | ((uint64_t)le32(p + 4) << 32); }

static PyObject *empty_tuple;
static PyObject *nul_str;

static PyObject *decode(PyObject *self, PyObject *args) {
    Py_buffer buf;
    Py_ssize_t pos, count;
    PyObject *ident;
    if (!PyArg_ParseTuple(args, "y*nnU", &buf, &pos, &count, &ident))
        return NULL;
    if (record_type == NULL) {
        PyBuffer_Release(&buf);
        PyErr_SetString(PyExc_RuntimeError, "lmqtt.store.client._records.configure() was not called or failed "
                        "(store/client/consumer.py configures it at import)");
        return NULL;
    }
    PyTypeObject *rt = record_type;
    const Py_ssize_t head = F_END;         /* the compiled record head size (configure() checked HEADER's) */
    const unsigned char *b = (const unsigned char *)buf.buf;
    Py_ssize_t n = buf.len;
    char idbuf[128];
    Py_ssize_t idlen;
    const char *id = PyUnicode_AsUTF8AndSize(ident, &idlen);
    if (id == NULL || idlen > 100 || !PyUnicode_IS_ASCII(ident)) {
        PyBuffer_Release(&buf);
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "ident must be ASCII, at most 100 characters");
        return NULL;
    }
    memcpy(idbuf, id, idlen);
    if (count < 0 || pos < 0) {
        PyBuffer_Release(&buf);
        PyErr_SetString(PyExc_ValueError, "negative count or position");
        return NULL;
    }
    PyObject *out = PyList_New(0);
    PyObject *topic = NULL, *props = NULL;          /* shared with the previous record */
    const unsigned char *topic_b = NULL, *props_b = NULL;
    Py_ssize_t topic_l = -1, props_l = -1;
    if (out == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (pos + head > n) {
            PyErr_Format(PyExc_ValueError, "record %zd: head truncated at byte %zd", i, pos);
            goto fail;
        }
        const unsigned char *h = b + pos;
        uint32_t total = le32(h + F_TOTAL);
        uint32_t bl = le32(h + F_BODY_LEN), pl = le32(h + F_PROPS_LEN);
        uint16_t tl = le16(h + F_TOPIC_LEN), kl = le16(h + F_KEYS_LEN), dl = le16(h + F_DQ_LEN);
        if ((uint64_t)pos + total > (uint64_t)n || (uint64_t)total != (uint64_t)head + tl + kl + dl + pl + bl) {
            PyErr_Format(PyExc_ValueError, "record at %zd of %u bytes does not fit its fields", pos, total);
            goto fail;
        }
        const unsigned char *p = h + head;
        if (topic == NULL || topic_l != tl || memcmp(topic_b, p, tl) != 0) {
            Py_XDECREF(topic);
            topic = PyUnicode_DecodeUTF8((const char *)p, tl, "strict");
            if (topic == NULL)
                goto fail;
            topic_b = p;
            topic_l = tl;
        }
        p += tl;
        PyObject *keys;
        if (kl) {
            PyObject *ks = PyUnicode_DecodeUTF8((const char *)p, kl, "strict");
            if (ks == NULL)
                goto fail;
            PyObject *lst = PyUnicode_Split(ks, nul_str, -1);
            Py_DECREF(ks);
            if (lst == NULL)
                goto fail;
            keys = PyList_AsTuple(lst);
            Py_DECREF(lst);
            if (keys == NULL)
                goto fail;
        } else {
            keys = Py_NewRef(empty_tuple);
        }
        p += kl + dl;
        if (props == NULL || props_l != pl || memcmp(props_b, p, pl) != 0) {
            Py_XDECREF(props);
            props = PyBytes_FromStringAndSize((const char *)p, pl);
            if (props == NULL) {
                Py_DECREF(keys);
                goto fail;
            }
            props_b = p;
            props_l = pl;
        }
        p += pl;
        uint64_t phys = le64(h + F_PHYS);
        snprintf(idbuf + idlen, sizeof idbuf - idlen, "%016llX", (unsigned long long)phys);
        PyObject *rec = rt->tp_alloc(rt, N_RECORD_FIELDS);
        if (rec == NULL) {
            Py_DECREF(keys);
            goto fail;
        }
        PyObject *f[N_RECORD_FIELDS];
        f[R_TOPIC] = Py_NewRef(topic);
        f[R_BODY] = PyBytes_FromStringAndSize((const char *)p, bl);
        f[R_KEYS] = keys;
        f[R_PROPS] = Py_NewRef(props);
        f[R_QUEUE_ID] = PyLong_FromUnsignedLong(le32(h + F_QID));
        f[R_QUEUE_OFFSET] = PyLong_FromUnsignedLongLong(le64(h + F_QOFF));
        f[R_OFFSET] = PyLong_FromUnsignedLongLong(phys);
        f[R_BORN_TS] = PyLong_FromUnsignedLongLong(le64(h + F_BORN));
        f[R_STORE_TS] = PyLong_FromUnsignedLongLong(le64(h + F_STORE));
        f[R_MSG_ID] = PyUnicode_FromStringAndSize(idbuf, idlen + 16);
        int bad = 0;
        for (int k = 0; k < N_RECORD_FIELDS; k++) {
            if (f[k] == NULL)
                bad = 1;
            PyTuple_SET_ITEM(rec, k, f[k]);   /* NULL items are fine for the dealloc below */
        }
        if (bad || PyList_Append(out, rec) < 0) {
            Py_DECREF(rec);
            goto fail;
        }
        if (record_untrack)
            PyObject_GC_UnTrack(rec);
        Py_DECREF(rec);
        pos += total;
    }
    Py_XDECREF(topic);
    Py_XDECREF(props);
    PyBuffer_Release(&buf);
    return out;
fail:
    Py_XDECREF(topic);
    Py_XDECREF(props);
    Py_XDECREF(out);
    PyBuffer_Release(&buf);
    return NULL;
}


/* ------------------------------------------------------------------ configuration */
#define READS "this decoder reads"

/* configure(Record, layout): layout = {"header_format": record.HEADER.format, "header_fields":
 * record.HEADER_FIELDS, "header_size": record.HEADER_SIZE} (consumer.C_LAYOUT). A refused
 * configuration leaves decode() unusable. */
static PyObject *configure(PyObject *self, PyObject *args) {
    PyObject *rtype, *layout;
    if (!PyArg_ParseTuple(args, "OO!", &rtype, &PyDict_Type, &layout)) return NULL;
    Py_CLEAR(record_type);
    if (!PyType_Check(rtype) || !PyType_IsSubtype((PyTypeObject *)rtype, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "configure: Record must be a tuple subclass");
        return NULL;
    }
    if (check_struct(layout, "record header", "header_format", "header_size", '<', record_head_fields,
                     N_FIELDS(record_head_fields), F_END, READS) < 0 ||
        check_names("record header", PyDict_GetItemString(layout, "header_fields"), record_head_fields,
                    N_FIELDS(record_head_fields), 1, READS) < 0)
        return NULL;
    PyObject *fields = PyObject_GetAttrString(rtype, "_fields");
    if (fields == NULL) return NULL;
    int ok = PyTuple_Check(fields) && PyTuple_GET_SIZE(fields) == N_RECORD_FIELDS;
    for (Py_ssize_t i = 0; ok && i < N_RECORD_FIELDS; i++) {
        PyObject *f = PyTuple_GET_ITEM(fields, i);
        ok = PyUnicode_Check(f) && PyUnicode_CompareWithASCIIString(f, record_fields[i]) == 0;
    }
    if (!ok) {
        PyErr_Format(PyExc_ValueError, "configure: Record._fields %R differ from the order this decoder "
                     "fills (topic, body, keys, props, queue_id, queue_offset, offset, born_ts, store_ts, "
                     "msg_id)", fields);
        Py_DECREF(fields);
        return NULL;
    }
    Py_DECREF(fields);
    record_type = (PyTypeObject *)Py_NewRef(rtype);
    record_untrack = record_type->tp_dictoffset == 0 && PyType_IS_GC(record_type);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS,
     "configure(Record, layout): the Record type and the record header layout, checked (see module doc)"},
    {"decode", decode, METH_VARARGS, "decode(body, pos, count, ident) -> [Record] (see module doc)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "lmqtt.store.client._records",
                                    "Raw MESSAGES -> SDK Records (C twin of records.records_raw).", -1, methods};

PyMODINIT_FUNC PyInit__records(void) {
    empty_tuple = PyTuple_New(0);
    nul_str = PyUnicode_FromStringAndSize("\0", 1);
    if (empty_tuple == NULL || nul_str == NULL)
        return NULL;
    return PyModule_Create(&moddef);
}
