/* store._append: the CommitLog's per-record encoding loop in C (optional accelerator), and its
 * per-record decode (the read side, see "decode" below: same layout, same CRC).
 *
 * Why: appending one record in Python costs ~3.7 us of CPU under the GIL (attribute reads, a
 * struct.pack, a CRC call, a named tuple per run, list appends), and the appender shares that GIL
 * with dispatch. This module does exactly what `store.encoding.encode_py` does, record for record
 * and byte for byte (tests/store/test_append_speedups.py and tests/store/test_encoding.py compare
 * them), so the Python loop stays the reference and the fallback when this does not build or
 * LMQTT_PURE_PYTHON=1 is set (store/accel.py loads it, store/encoding.py configures it).
 *
 * configure(DispatchRequest, InvalidMessage, check_size, Message, layout) must succeed first:
 * `layout` (store.encoding.LAYOUT) carries the record format from store/record.py, checked
 * against the record head this loop writes (store/_layout.h: offsets, widths and names).
 *
 * encode(msgs, commitlog, tcache, ncache, qt, phys, seg_end, seg, store_ts, maxsize, want_recent)
 *   -> (chunks, sizes, starts, runs, keyed, assigned, phys_end, recent_offs, recent, cq)
 *
 * `cq` is the one thing the Python loop does not build: {(first-level topic, queue id):
 * [first queue offset, bytearray of ConsumeQueue entries]} for the batch, so the ConsumeQueue
 * dispatcher writes a block per queue instead of packing an entry per record on the dispatch
 * thread (which shares the GIL with this appender).
 *
 * Cache misses (a new topic, a new dispatch-queue tuple, keys) call back into the CommitLog's own
 * Python methods, so validation and caching rules live in one place. Nothing here touches the
 * memory map: the caller copies the returned chunks in once the whole batch has encoded.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <limits.h>
#include <string.h>
#include <stdarg.h>
#include <stdio.h>

#include "_layout.h"

/* The record layout this loop writes (and decode below reads): store/_layout.h's CommitLog record
 * head, the F_* offsets and record_head_fields in the order of store/record.py's HEADER struct.
 * The sizes and magic numbers themselves are not repeated here: configure() receives them from
 * store/record.py and refuses a HEADER format or HEADER_FIELDS that differ from record_head_fields
 * in an offset, a width or a name (so a layout change in Python cannot silently produce records C
 * and Python disagree on). */
/* the ConsumeQueue entry packed per record: phys u64, size u32, tags u64 (store/consume_queue_entries.py
 * ENTRY), checked by configure() against ENTRY's format and ENTRY_FIELDS */
enum { CQ_PHYS = 0, CQ_SIZE = 8, CQ_TAGS = 12 };
static const field_t cq_entry_fields[] = {{"phys_offset", CQ_PHYS, 8}, {"size", CQ_SIZE, 4},
                                          {"tags_code", CQ_TAGS, 8}};
/* the DispatchRequest fields in the order this loop fills the tuple: dr_fields in store/_layout.h */
/* the fields of a recently appended record (the `recent` list) in the order encode() fills the
 * tuple: configure() refuses a layout whose recent_fields (store.message.RECENT_FIELDS, the order
 * CommitLog.read unpacks) are other names or another order. As field_t for check_names: the
 * offset is the position in the tuple, there is no width. */
enum { RF_TOPIC, RF_BODY, RF_PROPS, RF_QUEUE_ID, RF_QUEUE_OFFSET, RF_FLAGS, RF_SIZE, RF_BORN_TS, RF_STORE_TS,
       RF_KEYS, RF_DISPATCH_QUEUES, N_RF_FIELDS };
static const field_t recent_fields[N_RF_FIELDS] = {
    {"topic", RF_TOPIC, 0}, {"body", RF_BODY, 0}, {"props", RF_PROPS, 0}, {"queue_id", RF_QUEUE_ID, 0},
    {"queue_offset", RF_QUEUE_OFFSET, 0}, {"flags", RF_FLAGS, 0}, {"size", RF_SIZE, 0},
    {"born_ts", RF_BORN_TS, 0}, {"store_ts", RF_STORE_TS, 0}, {"keys", RF_KEYS, 0},
    {"dispatch_queues", RF_DISPATCH_QUEUES, 0}};

/* set by configure() from store/record.py; encode() refuses to run before */
static long long HEADER_SIZE = -1, MIN_BLANK, CRC_START, CQ_ENTRY_SIZE;
static uint32_t MSG_MAGIC, BLANK_MAGIC;
/* slots of a topic-info list (CommitLog._topic_info; TI_* in store/encoding.py), also from layout */
static Py_ssize_t ti_topic_bytes, ti_first_level, ti_tags, ti_dq, ti_dq_bytes, ti_len;

/* ------------------------------------------------------------------ CRC-32 (zlib's polynomial) */
static uint32_t crc_table[8][256];

static void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = crc_table[0][i];
        for (int t = 1; t < 8; t++) {
            c = crc_table[0][c & 0xFF] ^ (c >> 8);
            crc_table[t][i] = c;
        }
    }
}

/* slice-by-8; the record layout is little-endian and so is every platform this builds on
 * (checked at import, see module init) */
static uint32_t crc32_buf(uint32_t crc, const unsigned char *p, size_t n) {
    crc = ~crc;
    while (n && ((uintptr_t)p & 7)) { crc = crc_table[0][(crc ^ *p++) & 0xFF] ^ (crc >> 8); n--; }
    while (n >= 8) {
        uint32_t a, b;
        memcpy(&a, p, 4);
        memcpy(&b, p + 4, 4);
        a ^= crc;
        crc = crc_table[7][a & 0xFF] ^ crc_table[6][(a >> 8) & 0xFF] ^ crc_table[5][(a >> 16) & 0xFF] ^
              crc_table[4][a >> 24] ^ crc_table[3][b & 0xFF] ^ crc_table[2][(b >> 8) & 0xFF] ^
              crc_table[1][(b >> 16) & 0xFF] ^ crc_table[0][b >> 24];
        p += 8;
        n -= 8;
    }
    while (n--) crc = crc_table[0][(crc ^ *p++) & 0xFF] ^ (crc >> 8);
    return ~crc;
}

static PyObject *py_crc32(PyObject *self, PyObject *args) {
    Py_buffer b;
    unsigned int start = 0;
    if (!PyArg_ParseTuple(args, "y*|I", &b, &start)) return NULL;
    uint32_t c = crc32_buf(start, b.buf, (size_t)b.len);
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLong(c);
}

/* ------------------------------------------------------------------ configuration */
static PyObject *DR_type;          /* store.message.DispatchRequest (a tuple subclass) */
static PyObject *InvalidMessage;   /* store.errors.InvalidMessage */
static PyObject *check_size_fn;    /* store.record.check_size(total, maxsize): raises */
static PyTypeObject *Message_type; /* store.message.Message: slots read directly */
static Py_ssize_t off_topic = -1, off_body, off_qid, off_flags, off_props, off_keys, off_born, off_dq;
static PyObject *s_topic, *s_body, *s_queue_id, *s_flags, *s_props, *s_keys, *s_born_ts, *s_dq;
static PyObject *s_topic_info, *s_dq_info, *s_names, *s_keys_what, *s_dq_what;

#define WRITES "this encoder writes"

/* Take the record layout from store/record.py (`layout`, see store/encoding.py) and check it is
 * the one this loop writes; a mismatch raises ValueError naming the field, and encode() stays
 * unusable (at import store/encoding.py lets that ValueError propagate: the import of lmqtt.store
 * fails rather than fall back to the Python encoder unnoticed). */
static int configure_layout(PyObject *layout, PyObject *dr) {
    long long hs, mb, cs, mm, bm, cqsize;
    const char *cf;
    if (!PyDict_Check(layout)) {
        PyErr_SetString(PyExc_TypeError, "configure: layout must be a dict");
        return -1;
    }
    if (check_struct(layout, "record header", "header_format", "header_size", '<', record_head_fields,
                     N_FIELDS(record_head_fields), F_END, WRITES) < 0 ||
        check_names("record header", PyDict_GetItemString(layout, "header_fields"), record_head_fields,
                    N_FIELDS(record_head_fields), 1, WRITES) < 0)
        return -1;
    if (layout_int(layout, "header_size", &hs) < 0 || layout_int(layout, "min_blank", &mb) < 0 ||
        layout_int(layout, "crc_start", &cs) < 0 || layout_int(layout, "msg_magic", &mm) < 0 ||
        layout_int(layout, "blank_magic", &bm) < 0)
        return -1;
    if ((cf = layout_str(layout, "cq_entry_format")) == NULL ||
        check_format("ConsumeQueue entry", cf, '<', cq_entry_fields, N_FIELDS(cq_entry_fields), 1, &cqsize,
                     WRITES) < 0 ||
        check_names("ConsumeQueue entry", PyDict_GetItemString(layout, "cq_entry_fields"), cq_entry_fields,
                    N_FIELDS(cq_entry_fields), 1, WRITES) < 0)
        return -1;
    if (cs != F_QID) {
        PyErr_Format(PyExc_ValueError, "configure: crc_start %lld, this encoder checksums from the field "
                     "after the CRC (offset %d)", cs, (int)F_QID);
        return -1;
    }
    if (mb < F_MAGIC + 4) {
        PyErr_Format(PyExc_ValueError, "configure: min_blank %lld cannot hold a filler's size and magic", mb);
        return -1;
    }
    if (mm < 0 || mm > 0xFFFFFFFFll || bm < 0 || bm > 0xFFFFFFFFll || mm == bm) {
        PyErr_SetString(PyExc_ValueError, "configure: msg_magic and blank_magic must be distinct u32");
        return -1;
    }
    long long ti[6];
    const char *ti_keys[6] = {"ti_topic_bytes", "ti_first_level", "ti_tags", "ti_dq", "ti_dq_bytes", "ti_len"};
    for (int i = 0; i < 6; i++)
        if (layout_int(layout, ti_keys[i], &ti[i]) < 0) return -1;
    for (int i = 0; i < 6; i++) {
        if (ti[i] < 0 || ti[i] > 64 || (i < 5 && ti[i] >= ti[5])) {
            PyErr_Format(PyExc_ValueError, "configure: %s = %lld is out of range (ti_len %lld)", ti_keys[i],
                         ti[i], ti[5]);
            return -1;
        }
    }
    if (check_names("recent record", PyDict_GetItemString(layout, "recent_fields"), recent_fields, N_RF_FIELDS,
                    1, WRITES) < 0)
        return -1;
    int ok = fields_match(dr, dr_fields, N_DR_FIELDS);
    if (ok < 0) return -1;
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "configure: DispatchRequest._fields differ from the order this "
                        "encoder fills (phys_offset, size, topic, queue_id, queue_offset, flags, born_ts, "
                        "store_ts, tags_code, keys, dispatch_queues)");
        return -1;
    }
    HEADER_SIZE = hs;
    MIN_BLANK = mb;
    CRC_START = cs;
    CQ_ENTRY_SIZE = cqsize;
    MSG_MAGIC = (uint32_t)mm;
    BLANK_MAGIC = (uint32_t)bm;
    ti_topic_bytes = (Py_ssize_t)ti[0];
    ti_first_level = (Py_ssize_t)ti[1];
    ti_tags = (Py_ssize_t)ti[2];
    ti_dq = (Py_ssize_t)ti[3];
    ti_dq_bytes = (Py_ssize_t)ti[4];
    ti_len = (Py_ssize_t)ti[5];
    return 0;
}

static PyObject *configure(PyObject *self, PyObject *args) {
    PyObject *dr, *inv, *cs, *mt, *layout;
    if (!PyArg_ParseTuple(args, "OOOOO", &dr, &inv, &cs, &mt, &layout)) return NULL;
    if (!PyType_Check(dr) || !PyType_IsSubtype((PyTypeObject *)dr, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "DispatchRequest must be a tuple subclass");
        return NULL;
    }
    if (!PyType_Check(mt)) {
        PyErr_SetString(PyExc_TypeError, "Message must be a type");
        return NULL;
    }
    HEADER_SIZE = -1;
    if (configure_layout(layout, dr) < 0) return NULL;
    Py_XSETREF(DR_type, Py_NewRef(dr));
    Py_XSETREF(InvalidMessage, Py_NewRef(inv));
    Py_XSETREF(check_size_fn, Py_NewRef(cs));
    Py_XSETREF(Message_type, (PyTypeObject *)Py_NewRef(mt));
    PyTypeObject *tp = (PyTypeObject *)mt;
    off_topic = slot_offset(tp, "topic");
    off_body = slot_offset(tp, "body");
    off_qid = slot_offset(tp, "queue_id");
    off_flags = slot_offset(tp, "flags");
    off_props = slot_offset(tp, "props");
    off_keys = slot_offset(tp, "keys");
    off_born = slot_offset(tp, "born_ts");
    off_dq = slot_offset(tp, "dispatch_queues");
    if (off_topic < 0 || off_body < 0 || off_qid < 0 || off_flags < 0 || off_props < 0 || off_keys < 0 ||
        off_born < 0 || off_dq < 0)
        off_topic = -1; /* not a plain __slots__ class: read attributes by name */
    Py_RETURN_NONE;
}

/* A new reference to attribute `name` of message `m` (slot read for exact Message instances). */
static inline PyObject *mattr(PyObject *m, Py_ssize_t off, PyObject *name) {
    if (off_topic >= 0 && Py_TYPE(m) == Message_type) {
        PyObject *v = *(PyObject **)((char *)m + off);
        if (v != NULL) return Py_NewRef(v);
    }
    return PyObject_GetAttr(m, name);
}

/* ------------------------------------------------------------------ output buffer */
typedef struct {
    PyObject *bytes; /* PyBytes being filled, resized as it grows */
    Py_ssize_t len;
} outbuf;

static unsigned char *ob_reserve(outbuf *o, Py_ssize_t n) {
    Py_ssize_t cap = PyBytes_GET_SIZE(o->bytes);
    if (o->len + n > cap) {
        Py_ssize_t nc = cap * 2;
        if (nc < o->len + n) nc = o->len + n + 4096;
        if (_PyBytes_Resize(&o->bytes, nc) < 0) return NULL;
    }
    return (unsigned char *)PyBytes_AS_STRING(o->bytes) + o->len;
}

static int ob_new(outbuf *o, Py_ssize_t cap) {
    o->bytes = PyBytes_FromStringAndSize(NULL, cap < 4096 ? 4096 : cap);
    o->len = 0;
    return o->bytes ? 0 : -1;
}

/* close the current buffer into chunks as (cstart, bytes) */
static int ob_close(outbuf *o, PyObject *chunks, long long cstart) {
    if (_PyBytes_Resize(&o->bytes, o->len) < 0) return -1;
    PyObject *t = Py_BuildValue("(LN)", cstart, o->bytes);
    o->bytes = NULL;
    if (t == NULL) return -1;
    int r = PyList_Append(chunks, t);
    Py_DECREF(t);
    return r;
}

static inline void put32(unsigned char *p, uint32_t v) { memcpy(p, &v, 4); }
static inline void put64(unsigned char *p, uint64_t v) { memcpy(p, &v, 8); }
static inline void put16(unsigned char *p, uint16_t v) { memcpy(p, &v, 2); }

static int invalid(const char *what) {
    /* turn a conversion error (TypeError/OverflowError/ValueError) into InvalidMessage */
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    PyErr_NormalizeException(&et, &ev, &tb);
    PyObject *s = ev ? PyObject_Str(ev) : NULL;
    PyErr_Format(InvalidMessage, "%s: %S; nothing was written", what, s ? s : Py_None);
    Py_XDECREF(s);
    Py_XDECREF(et);
    Py_XDECREF(ev);
    Py_XDECREF(tb);
    return -1;
}

/* A cached-names lookup: ncache.get(names) or commitlog._names(names, what). New reference. */
static PyObject *names_bytes(PyObject *cl, PyObject *ncache, PyObject *names, PyObject *what) {
    PyObject *b = PyDict_GetItemWithError(ncache, names);
    if (b != NULL && PyObject_IsTrue(b)) return Py_NewRef(b);
    if (PyErr_Occurred()) return NULL;
    return PyObject_CallMethodObjArgs(cl, s_names, names, what, NULL);
}

/* ------------------------------------------------------------------ encode */
static PyObject *encode(PyObject *self, PyObject *args) {
    PyObject *msgs, *cl, *tcache, *ncache, *qt, *store_ts_o;
    long long phys, seg_end, seg, maxsize;
    int want_recent;
    if (!PyArg_ParseTuple(args, "O!OO!O!O!LLLOLp", &PyList_Type, &msgs, &cl, &PyDict_Type, &tcache,
                          &PyDict_Type, &ncache, &PyDict_Type, &qt, &phys, &seg_end, &seg, &store_ts_o,
                          &maxsize, &want_recent))
        return NULL;
    if (DR_type == NULL || HEADER_SIZE < 0) {
        PyErr_SetString(PyExc_RuntimeError, "lmqtt.store._append.configure() was not called or failed");
        return NULL;
    }
    uint64_t store_ts = PyLong_AsUnsignedLongLong(store_ts_o);
    if (PyErr_Occurred()) return NULL;

    Py_ssize_t n = PyList_GET_SIZE(msgs);
    PyObject *chunks = PyList_New(0), *sizes = PyList_New(0), *starts = PyList_New(0),
             *runs = PyList_New(0), *assigned = PyDict_New(), *recent_offs = PyList_New(0),
             *recent = PyList_New(0), *cqg = PyDict_New();
    PyObject *cq_cur = NULL;   /* bytearray of the current (first level, queue id) in cqg */
    PyObject *result = NULL;
    outbuf ob = {NULL, 0};
    /* the current run's fields (borrowed from the message being looked at or held below) */
    PyObject *r_topic = NULL, *r_qid = NULL, *r_flags = NULL, *r_born = NULL, *r_keys = NULL, *r_dq = NULL;
    PyObject *t = NULL;   /* topic info list (borrowed from tcache; kept alive by `t_ref`) */
    PyObject *t_ref = NULL, *kb = NULL, *db = NULL, *tags_o = NULL;
    PyObject *last_fl = NULL, *last_qid_o = NULL;
    const char *tbp = NULL, *kbp = "", *dbp = "";
    Py_ssize_t tl = 0, kl = 0, dl = 0;
    uint64_t tags = 0;
    uint32_t qid = 0, flags = 0;
    uint64_t born = 0;
    long long qoff = 0;
    long long limit = seg_end - MIN_BLANK;
    long long cstart = phys;
    int keyed = 0;
    PyObject *topic = NULL, *qid_o = NULL, *flags_o = NULL, *born_o = NULL, *keys = NULL, *dq = NULL,
             *body = NULL, *props = NULL;

    if (!chunks || !sizes || !starts || !runs || !assigned || !recent_offs || !recent || !cqg) goto done;
    if (ob_new(&ob, n * 180) < 0) goto done;   /* a guess (~100 B payload records); it grows */

    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *m = PyList_GET_ITEM(msgs, i);
        topic = mattr(m, off_topic, s_topic);
        qid_o = topic ? mattr(m, off_qid, s_queue_id) : NULL;
        flags_o = qid_o ? mattr(m, off_flags, s_flags) : NULL;
        born_o = flags_o ? mattr(m, off_born, s_born_ts) : NULL;
        keys = born_o ? mattr(m, off_keys, s_keys) : NULL;
        dq = keys ? mattr(m, off_dq, s_dq) : NULL;
        body = dq ? mattr(m, off_body, s_body) : NULL;
        props = body ? mattr(m, off_props, s_props) : NULL;
        if (props == NULL) goto done;
        int new_run = 0;
        if (topic != r_topic || qid_o != r_qid || flags_o != r_flags || born_o != r_born || keys != r_keys ||
            dq != r_dq) {
            new_run = 1;
            if (topic != r_topic) {
                PyObject *ti = PyDict_GetItemWithError(tcache, topic);
                if (ti == NULL) {
                    if (PyErr_Occurred()) goto done;
                    ti = PyObject_CallMethodObjArgs(cl, s_topic_info, topic, NULL);
                    if (ti == NULL) goto done;
                } else {
                    Py_INCREF(ti);
                }
                if (!PyList_Check(ti) || PyList_GET_SIZE(ti) < ti_len) {
                    Py_DECREF(ti);
                    PyErr_SetString(PyExc_RuntimeError, "topic info is not a list of the configured length");
                    goto done;
                }
                Py_XSETREF(t_ref, ti);
                t = ti;
                PyObject *tb = PyList_GET_ITEM(t, ti_topic_bytes);
                tbp = PyBytes_AS_STRING(tb);
                tl = PyBytes_GET_SIZE(tb);
                tags_o = PyList_GET_ITEM(t, ti_tags);
                tags = PyLong_AsUnsignedLongLong(tags_o);
                if (PyErr_Occurred()) goto done;
            }
            int has_keys = PyObject_IsTrue(keys);
            if (has_keys < 0) goto done;
            int has_dq = PyObject_IsTrue(dq);
            if (has_dq < 0) goto done;
            if (has_keys) {
                keyed = 1;
                Py_XSETREF(kb, names_bytes(cl, ncache, keys, s_keys_what));
                if (kb == NULL) goto done;
                if (has_dq) {
                    Py_XSETREF(db, names_bytes(cl, ncache, dq, s_dq_what));
                    if (db == NULL) goto done;
                } else {
                    Py_XSETREF(db, PyBytes_FromStringAndSize("", 0));
                }
            } else if (has_dq) {
                if (PyList_GET_ITEM(t, ti_dq) != dq) {
                    PyObject *r = PyObject_CallMethodObjArgs(cl, s_dq_info, t, dq, NULL);
                    if (r == NULL) goto done;
                    Py_DECREF(r);
                }
                Py_XSETREF(kb, PyBytes_FromStringAndSize("", 0));
                Py_XSETREF(db, Py_NewRef(PyList_GET_ITEM(t, ti_dq_bytes)));
            } else {
                Py_XSETREF(kb, PyBytes_FromStringAndSize("", 0));
                Py_XSETREF(db, PyBytes_FromStringAndSize("", 0));
            }
            if (!PyBytes_Check(kb) || !PyBytes_Check(db)) {
                PyErr_SetString(PyExc_RuntimeError, "names must encode to bytes");
                goto done;
            }
            kbp = PyBytes_AS_STRING(kb);
            kl = PyBytes_GET_SIZE(kb);
            dbp = PyBytes_AS_STRING(db);
            dl = PyBytes_GET_SIZE(db);
            /* numeric fields, checked as struct.pack would (u32, u32, u64) */
            unsigned long q = PyLong_AsUnsignedLong(qid_o);
            if (PyErr_Occurred() || q > 0xFFFFFFFFul) {
                if (!PyErr_Occurred()) PyErr_SetString(PyExc_OverflowError, "queue_id above 2**32-1");
                invalid("a numeric field is out of range (queue_id/flags u32, born_ts u64 non-negative)");
                goto done;
            }
            unsigned long f = PyLong_AsUnsignedLong(flags_o);
            if (PyErr_Occurred() || f > 0xFFFFFFFFul) {
                if (!PyErr_Occurred()) PyErr_SetString(PyExc_OverflowError, "flags above 2**32-1");
                invalid("a numeric field is out of range (queue_id/flags u32, born_ts u64 non-negative)");
                goto done;
            }
            born = PyLong_AsUnsignedLongLong(born_o);
            if (PyErr_Occurred()) {
                invalid("a numeric field is out of range (queue_id/flags u32, born_ts u64 non-negative)");
                goto done;
            }
            PyObject *fl = PyList_GET_ITEM(t, ti_first_level);
            if (last_fl == NULL || (uint32_t)q != qid || fl != last_fl) {
                PyObject *key;
                if (last_fl != NULL) {
                    key = PyTuple_Pack(2, last_fl, last_qid_o);
                    PyObject *v = key ? PyLong_FromLongLong(qoff) : NULL;
                    int r = v ? PyDict_SetItem(assigned, key, v) : -1;
                    Py_XDECREF(key);
                    Py_XDECREF(v);
                    if (r < 0) goto done;
                }
                key = PyTuple_Pack(2, fl, qid_o);
                if (key == NULL) goto done;
                PyObject *v = PyDict_GetItemWithError(assigned, key);
                if (v == NULL && !PyErr_Occurred()) v = PyDict_GetItemWithError(qt, key);
                if (v == NULL) {
                    if (PyErr_Occurred()) { Py_DECREF(key); goto done; }
                    qoff = 0;
                } else {
                    qoff = PyLong_AsLongLong(v);
                    if (PyErr_Occurred()) { Py_DECREF(key); goto done; }
                }
                PyObject *g = PyDict_GetItemWithError(cqg, key);
                if (g == NULL) {
                    if (PyErr_Occurred()) { Py_DECREF(key); goto done; }
                    g = Py_BuildValue("[LN]", qoff, PyByteArray_FromStringAndSize(NULL, 0));
                    int r = g ? PyDict_SetItem(cqg, key, g) : -1;
                    Py_XDECREF(g);   /* the dict holds it */
                    if (r < 0) { Py_DECREF(key); goto done; }
                }
                Py_DECREF(key);
                cq_cur = PyList_GET_ITEM(g, 1);
                Py_XSETREF(last_fl, Py_NewRef(fl));
                Py_XSETREF(last_qid_o, Py_NewRef(qid_o));
            }
            qid = (uint32_t)q;
            flags = (uint32_t)f;
            Py_XSETREF(r_topic, Py_NewRef(topic));
            Py_XSETREF(r_qid, Py_NewRef(qid_o));
            Py_XSETREF(r_flags, Py_NewRef(flags_o));
            Py_XSETREF(r_born, Py_NewRef(born_o));
            Py_XSETREF(r_keys, Py_NewRef(keys));
            Py_XSETREF(r_dq, Py_NewRef(dq));
        }
        Py_buffer bb, pb;
        if (PyObject_GetBuffer(body, &bb, PyBUF_SIMPLE) < 0) {
            invalid("body and props must be bytes-like");
            goto done;
        }
        if (PyObject_GetBuffer(props, &pb, PyBUF_SIMPLE) < 0) {
            PyBuffer_Release(&bb);
            invalid("body and props must be bytes-like");
            goto done;
        }
        Py_ssize_t bl = bb.len, pl = pb.len;
        long long hbase = HEADER_SIZE + tl + kl + dl;
        long long total = hbase + bl + pl;
        if (total > maxsize) {
            PyBuffer_Release(&bb);
            PyBuffer_Release(&pb);
            PyObject *r = PyObject_CallFunction(check_size_fn, "LL", total, maxsize);
            Py_XDECREF(r);
            if (r != NULL) PyErr_SetString(PyExc_RuntimeError, "check_size did not raise");
            goto done;
        }
        if (bl > 0xFFFFFFFFll || pl > 0xFFFFFFFFll) {
            PyBuffer_Release(&bb);
            PyBuffer_Release(&pb);
            PyErr_SetString(PyExc_OverflowError, "body/props above 2**32-1 bytes");
            invalid("a numeric field is out of range");
            goto done;
        }
        if (phys + total > limit) { /* close the segment with a blank filler */
            unsigned char *p = ob_reserve(&ob, MIN_BLANK);
            if (p == NULL) { PyBuffer_Release(&bb); PyBuffer_Release(&pb); goto done; }
            put32(p + F_TOTAL, (uint32_t)(seg_end - phys));
            put32(p + F_MAGIC, BLANK_MAGIC);
            ob.len += MIN_BLANK;
            if (ob_close(&ob, chunks, cstart) < 0 || ob_new(&ob, 1 << 16) < 0) {
                PyBuffer_Release(&bb); PyBuffer_Release(&pb); goto done;
            }
            phys = cstart = seg_end;
            seg_end += seg;
            limit = seg_end - MIN_BLANK;
            new_run = 1;
        }
        PyObject *total_o = PyLong_FromLongLong(total);
        if (total_o == NULL) { PyBuffer_Release(&bb); PyBuffer_Release(&pb); goto done; }
        if (new_run) {
            PyObject *si = PyLong_FromSsize_t(PyList_GET_SIZE(sizes));
            int r = si ? PyList_Append(starts, si) : -1;
            Py_XDECREF(si);
            PyObject *dr = r < 0 ? NULL : ((PyTypeObject *)DR_type)->tp_alloc((PyTypeObject *)DR_type, N_DR_FIELDS);
            if (dr == NULL) { Py_DECREF(total_o); PyBuffer_Release(&bb); PyBuffer_Release(&pb); goto done; }
            PyObject *ph = PyLong_FromLongLong(phys), *qo = PyLong_FromLongLong(qoff);
            if (ph == NULL || qo == NULL) {
                Py_XDECREF(ph); Py_XDECREF(qo); Py_DECREF(dr); Py_DECREF(total_o);
                PyBuffer_Release(&bb); PyBuffer_Release(&pb); goto done;
            }
            PyTuple_SET_ITEM(dr, 0, ph);
            PyTuple_SET_ITEM(dr, 1, Py_NewRef(total_o));
            PyTuple_SET_ITEM(dr, 2, Py_NewRef(topic));
            PyTuple_SET_ITEM(dr, 3, Py_NewRef(qid_o));
            PyTuple_SET_ITEM(dr, 4, qo);
            PyTuple_SET_ITEM(dr, 5, Py_NewRef(flags_o));
            PyTuple_SET_ITEM(dr, 6, Py_NewRef(born_o));
            PyTuple_SET_ITEM(dr, 7, Py_NewRef(store_ts_o));
            PyTuple_SET_ITEM(dr, 8, Py_NewRef(tags_o));
            PyTuple_SET_ITEM(dr, 9, Py_NewRef(keys));
            PyTuple_SET_ITEM(dr, 10, Py_NewRef(dq));
            r = PyList_Append(runs, dr);
            Py_DECREF(dr);
            if (r < 0) { Py_DECREF(total_o); PyBuffer_Release(&bb); PyBuffer_Release(&pb); goto done; }
        }
        unsigned char *p = ob_reserve(&ob, (Py_ssize_t)total);
        if (p == NULL) { Py_DECREF(total_o); PyBuffer_Release(&bb); PyBuffer_Release(&pb); goto done; }
        put32(p + F_TOTAL, (uint32_t)total);
        put32(p + F_MAGIC, MSG_MAGIC);
        put32(p + F_QID, qid);
        put32(p + F_FLAGS, flags);
        put64(p + F_QOFF, (uint64_t)qoff);
        put64(p + F_PHYS, (uint64_t)phys);
        put64(p + F_BORN, born);
        put64(p + F_STORE, store_ts);
        put64(p + F_TAGS, tags);
        put32(p + F_BODY_LEN, (uint32_t)bl);
        put32(p + F_PROPS_LEN, (uint32_t)pl);
        put16(p + F_TOPIC_LEN, (uint16_t)tl);
        put16(p + F_KEYS_LEN, (uint16_t)kl);
        put16(p + F_DQ_LEN, (uint16_t)dl);
        unsigned char *q = p + HEADER_SIZE;
        memcpy(q, tbp, tl); q += tl;
        memcpy(q, kbp, kl); q += kl;
        memcpy(q, dbp, dl); q += dl;
        memcpy(q, pb.buf, pl); q += pl;
        memcpy(q, bb.buf, bl);
        PyBuffer_Release(&bb);
        PyBuffer_Release(&pb);
        put32(p + F_CRC, crc32_buf(0, p + CRC_START, (size_t)(total - CRC_START)));
        ob.len += total;
        {   /* the ConsumeQueue entry: phys u64, size u32, tags u64 (store/consume_queue_entries.py) */
            Py_ssize_t cl0 = PyByteArray_GET_SIZE(cq_cur);
            if (PyByteArray_Resize(cq_cur, cl0 + CQ_ENTRY_SIZE) < 0) { Py_DECREF(total_o); goto done; }
            unsigned char *e = (unsigned char *)PyByteArray_AS_STRING(cq_cur) + cl0;
            put64(e + CQ_PHYS, (uint64_t)phys);
            put32(e + CQ_SIZE, (uint32_t)total);
            put64(e + CQ_TAGS, tags);
        }
        if (PyList_Append(sizes, total_o) < 0) { Py_DECREF(total_o); goto done; }
        if (want_recent && PyBytes_CheckExact(body) && PyBytes_CheckExact(props)) {
            PyObject *ph = PyLong_FromLongLong(phys);
            PyObject *qo = ph ? PyLong_FromLongLong(qoff) : NULL;
            PyObject *fields = qo ? PyTuple_New(N_RF_FIELDS) : NULL;
            if (fields != NULL) {   /* in recent_fields order (checked by configure) */
                PyTuple_SET_ITEM(fields, RF_TOPIC, Py_NewRef(topic));
                PyTuple_SET_ITEM(fields, RF_BODY, Py_NewRef(body));
                PyTuple_SET_ITEM(fields, RF_PROPS, Py_NewRef(props));
                PyTuple_SET_ITEM(fields, RF_QUEUE_ID, Py_NewRef(qid_o));
                PyTuple_SET_ITEM(fields, RF_QUEUE_OFFSET, Py_NewRef(qo));
                PyTuple_SET_ITEM(fields, RF_FLAGS, Py_NewRef(flags_o));
                PyTuple_SET_ITEM(fields, RF_SIZE, Py_NewRef(total_o));
                PyTuple_SET_ITEM(fields, RF_BORN_TS, Py_NewRef(born_o));
                PyTuple_SET_ITEM(fields, RF_STORE_TS, Py_NewRef(store_ts_o));
                PyTuple_SET_ITEM(fields, RF_KEYS, Py_NewRef(keys));
                PyTuple_SET_ITEM(fields, RF_DISPATCH_QUEUES, Py_NewRef(dq));
            }
            Py_XDECREF(qo);
            int r = fields ? PyList_Append(recent_offs, ph) : -1;
            if (r == 0) r = PyList_Append(recent, fields);
            Py_XDECREF(ph);
            Py_XDECREF(fields);
            if (r < 0) { Py_DECREF(total_o); goto done; }
        }
        Py_DECREF(total_o);
        qoff += 1;
        phys += total;
        Py_CLEAR(topic); Py_CLEAR(qid_o); Py_CLEAR(flags_o); Py_CLEAR(born_o);
        Py_CLEAR(keys); Py_CLEAR(dq); Py_CLEAR(body); Py_CLEAR(props);
    }
    if (last_fl != NULL) {
        PyObject *key = PyTuple_Pack(2, last_fl, last_qid_o);
        PyObject *v = key ? PyLong_FromLongLong(qoff) : NULL;
        int r = v ? PyDict_SetItem(assigned, key, v) : -1;
        Py_XDECREF(key);
        Py_XDECREF(v);
        if (r < 0) goto done;
    }
    if (PyList_GET_SIZE(sizes)) {
        if (ob_close(&ob, chunks, cstart) < 0) goto done;
    }
    result = Py_BuildValue("(OOOOOOLOOO)", chunks, sizes, starts, runs, keyed ? Py_True : Py_False, assigned,
                           phys, recent_offs, recent, cqg);
done:
    if (result == NULL && PyErr_ExceptionMatches(PyExc_TypeError))
        invalid("body and props must be bytes-like");   /* as the Python loop: any TypeError */
    Py_XDECREF(topic); Py_XDECREF(qid_o); Py_XDECREF(flags_o); Py_XDECREF(born_o);
    Py_XDECREF(keys); Py_XDECREF(dq); Py_XDECREF(body); Py_XDECREF(props);
    Py_XDECREF(ob.bytes);
    Py_XDECREF(r_topic); Py_XDECREF(r_qid); Py_XDECREF(r_flags); Py_XDECREF(r_born);
    Py_XDECREF(r_keys); Py_XDECREF(r_dq);
    Py_XDECREF(t_ref); Py_XDECREF(kb); Py_XDECREF(db);
    Py_XDECREF(last_fl); Py_XDECREF(last_qid_o);
    Py_XDECREF(chunks); Py_XDECREF(sizes); Py_XDECREF(starts); Py_XDECREF(runs);
    Py_XDECREF(assigned); Py_XDECREF(recent_offs); Py_XDECREF(recent); Py_XDECREF(cqg);
    return result;
}

/* ------------------------------------------------------------------ decode (the read side)
 *
 * decode(buf, pos, phys_offset, ident, verify=True, end=None) -> StoredMessage
 * decode_many(buf, base, wanted, i, ident, out, verify=True) -> next i
 *
 * The same as store.record.decode / decode_many, field for field and error for error (class and
 * message; tests/store/test_record_decode_accel.py compares them). Why here and not in a module
 * of its own: the read side checks the same record layout (header field offsets, CRC start, magic)
 * with the same CRC as the encoder above, so it shares the layout check and the CRC table instead
 * of repeating them. Why at all: py-spy put 261 of 920 samples of a replay in the Python decode
 * (one struct unpack, one CRC call, five slices and a format per record).
 *
 * `buf` is anything with the buffer protocol, normally the segment's mmap itself: the record is
 * read in place (no slice copy); the buffer is held only for the duration of the call. `end`
 * bounds the record (CommitLog.read passes pos + the size the index recorded), like the slice the
 * Python path decodes. decode_many decodes `wanted[i:]` [(phys, size), ...] while their phys lie
 * in [base, base + len(buf)) and appends to `out` a StoredMessage or, for a record that fails its
 * checks, the exception instance (CorruptRecord...) - the caller decides whether that is an error.
 * Within one call equal topics, props and key / queue lists give one shared object (immutable). */
static PyObject *SM_type;        /* store.message.StoredMessage (a tuple subclass) */
/* Decoded messages are untracked by the cyclic GC: a StoredMessage holds only str, bytes, int and
 * tuples of str, so it can never be part of a reference cycle, yet as a tuple *subclass* the
 * collector never untracks it by itself (it does so for exact tuples only). The light queues' message
 * cache keeps up to 200,000 of them, and every older-generation collection scanned each one again
 * (with the cache's entries and the publish batches, 12-20 % of the event loop of a broker whose
 * subscriber fell behind). Only when the class has no instance dict (`__slots__ = ()`), which
 * could hold anything. */
static int SM_untrack;
static PyObject *CorruptRecord;  /* store.errors.CorruptRecord */
static long long R_HEADER_SIZE = -1, R_CRC_START;
static uint32_t R_MSG_MAGIC;
static PyObject *s_nul;          /* "\0": the separator of keys and dispatch queues */
static const char *const sm_fields[] = {"topic", "body", "props", "queue_id", "flags", "queue_offset",
                                        "phys_offset", "size", "born_ts", "store_ts", "msg_id", "keys",
                                        "dispatch_queues"};
#define N_SM_FIELDS ((Py_ssize_t)(sizeof sm_fields / sizeof sm_fields[0]))

#define READS "this decoder reads"

static PyObject *configure_reader(PyObject *self, PyObject *args) {
    PyObject *sm, *cr, *layout;
    long long hs, cs, mm;
    if (!PyArg_ParseTuple(args, "OOO!", &sm, &cr, &PyDict_Type, &layout)) return NULL;
    if (!PyType_Check(sm) || !PyType_IsSubtype((PyTypeObject *)sm, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "StoredMessage must be a tuple subclass");
        return NULL;
    }
    if (!PyType_Check(cr) || !PyType_IsSubtype((PyTypeObject *)cr, (PyTypeObject *)PyExc_Exception)) {
        PyErr_SetString(PyExc_TypeError, "CorruptRecord must be an exception class");
        return NULL;
    }
    R_HEADER_SIZE = -1;
    if (check_struct(layout, "record header", "header_format", "header_size", '<', record_head_fields,
                     N_FIELDS(record_head_fields), F_END, READS) < 0 ||
        check_names("record header", PyDict_GetItemString(layout, "header_fields"), record_head_fields,
                    N_FIELDS(record_head_fields), 1, READS) < 0)
        return NULL;
    if (layout_int(layout, "header_size", &hs) < 0 || layout_int(layout, "crc_start", &cs) < 0 ||
        layout_int(layout, "msg_magic", &mm) < 0)
        return NULL;
    if (cs != F_QID) {
        PyErr_Format(PyExc_ValueError, "configure_reader: crc_start %lld, this decoder checksums from "
                     "the field after the CRC (offset %d)", cs, (int)F_QID);
        return NULL;
    }
    if (mm < 0 || mm > 0xFFFFFFFFll) {
        PyErr_SetString(PyExc_ValueError, "configure_reader: msg_magic must be a u32");
        return NULL;
    }
    int ok = fields_match(sm, sm_fields, N_SM_FIELDS);
    if (ok < 0) return NULL;
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "configure_reader: StoredMessage._fields differ from the order "
                        "this decoder fills (topic, body, props, queue_id, flags, queue_offset, phys_offset, "
                        "size, born_ts, store_ts, msg_id, keys, dispatch_queues)");
        return NULL;
    }
    Py_XSETREF(SM_type, Py_NewRef(sm));
    SM_untrack = ((PyTypeObject *)sm)->tp_dictoffset == 0 && PyType_IS_GC((PyTypeObject *)sm);
    Py_XSETREF(CorruptRecord, Py_NewRef(cr));
    R_HEADER_SIZE = hs;
    R_CRC_START = cs;
    R_MSG_MAGIC = (uint32_t)mm;
    Py_RETURN_NONE;
}

static inline uint32_t get32(const unsigned char *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint64_t get64(const unsigned char *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline uint16_t get16(const unsigned char *p) { uint16_t v; memcpy(&v, p, 2); return v; }

/* objects shared between the records of one call: the last topic / props / keys / queues seen */
typedef struct {
    PyObject *topic_raw, *topic, *props, *keys_raw, *keys, *dq_raw, *dq;
} dshare;

static void dshare_clear(dshare *d) {
    Py_CLEAR(d->topic_raw); Py_CLEAR(d->topic); Py_CLEAR(d->props);
    Py_CLEAR(d->keys_raw); Py_CLEAR(d->keys); Py_CLEAR(d->dq_raw); Py_CLEAR(d->dq);
}

static inline int same_raw(PyObject *raw, const unsigned char *p, Py_ssize_t n) {
    return raw != NULL && PyBytes_GET_SIZE(raw) == n && memcmp(PyBytes_AS_STRING(raw), p, (size_t)n) == 0;
}

/* `raw` decoded as UTF-8 (as_list: split on NUL into a tuple), shared with the previous record when
 * the bytes are equal. New reference. */
static PyObject *shared_text(PyObject **raw_slot, PyObject **val_slot, const unsigned char *p, Py_ssize_t n,
                             int as_list) {
    if (same_raw(*raw_slot, p, n)) return Py_NewRef(*val_slot);
    PyObject *s = PyUnicode_DecodeUTF8((const char *)p, n, "strict");
    if (s == NULL) return NULL;
    if (as_list) {
        PyObject *parts = PyUnicode_Split(s, s_nul, -1);
        Py_DECREF(s);
        if (parts == NULL) return NULL;
        s = PyList_AsTuple(parts);
        Py_DECREF(parts);
        if (s == NULL) return NULL;
        PyObject_GC_UnTrack(s);      /* strings only: as the message that holds it (above) */
    }
    PyObject *raw = PyBytes_FromStringAndSize((const char *)p, n);
    if (raw == NULL) { Py_DECREF(s); return NULL; }
    Py_XSETREF(*raw_slot, raw);
    Py_XSETREF(*val_slot, Py_NewRef(s));
    return s;
}

static void corrupt(const char *fmt, ...) {
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    PyErr_SetString(CorruptRecord, msg);
}

/* The record at buf[pos:] (bounded by limit) whose CommitLog offset is phys_o; NULL with
 * CorruptRecord (the messages of store.record.decode) or another error set. */
static PyObject *decode_at(const unsigned char *buf, Py_ssize_t limit, Py_ssize_t pos, PyObject *phys_o,
                           long long phys_offset, PyObject *ident, int verify, dshare *sh) {
    const long long HS = R_HEADER_SIZE;
    if (pos < 0 || pos + HS > limit) {
        corrupt("record at offset %lld: header runs past the segment end", phys_offset);
        return NULL;
    }
    const unsigned char *r = buf + pos;
    uint32_t total = get32(r + F_TOTAL), magic = get32(r + F_MAGIC), crc = get32(r + F_CRC);
    uint64_t phys = get64(r + F_PHYS);
    uint32_t blen = get32(r + F_BODY_LEN), plen = get32(r + F_PROPS_LEN);
    uint16_t tlen = get16(r + F_TOPIC_LEN), klen = get16(r + F_KEYS_LEN), dlen = get16(r + F_DQ_LEN);
    if (magic != R_MSG_MAGIC) {
        corrupt("no record at offset %lld (magic 0x%08x)", phys_offset, (unsigned)magic);
        return NULL;
    }
    if (phys_offset < 0 || phys != (uint64_t)phys_offset ||
        (long long)total != HS + tlen + klen + dlen + (long long)plen + (long long)blen ||
        pos + (long long)total > limit) {
        corrupt("record at offset %lld: inconsistent framing (size %u, stored offset %llu)", phys_offset,
                (unsigned)total, (unsigned long long)phys);
        return NULL;
    }
    if (verify && crc32_buf(0, r + R_CRC_START, (size_t)(total - R_CRC_START)) != crc) {
        corrupt("record at offset %lld: CRC mismatch (corrupt data, not served)", phys_offset);
        return NULL;
    }
    const unsigned char *p = r + HS;
    PyObject *sm = ((PyTypeObject *)SM_type)->tp_alloc((PyTypeObject *)SM_type, N_SM_FIELDS);
    if (sm == NULL) return NULL;
    PyObject *v;
#define SET(i, expr) do { if ((v = (expr)) == NULL) goto fail; PyTuple_SET_ITEM(sm, i, v); } while (0)
    SET(0, shared_text(&sh->topic_raw, &sh->topic, p, tlen, 0));
    p += tlen;
    SET(11, klen ? shared_text(&sh->keys_raw, &sh->keys, p, klen, 1) : PyTuple_New(0));
    p += klen;
    SET(12, dlen ? shared_text(&sh->dq_raw, &sh->dq, p, dlen, 1) : PyTuple_New(0));
    p += dlen;
    if (same_raw(sh->props, p, plen)) {
        SET(2, Py_NewRef(sh->props));
    } else {
        SET(2, PyBytes_FromStringAndSize((const char *)p, plen));
        Py_XSETREF(sh->props, Py_NewRef(v));
    }
    p += plen;
    SET(1, PyBytes_FromStringAndSize((const char *)p, blen));
    SET(3, PyLong_FromUnsignedLong(get32(r + F_QID)));
    SET(4, PyLong_FromUnsignedLong(get32(r + F_FLAGS)));
    SET(5, PyLong_FromUnsignedLongLong(get64(r + F_QOFF)));
    SET(6, Py_NewRef(phys_o));
    SET(7, PyLong_FromUnsignedLong(total));
    SET(8, PyLong_FromUnsignedLongLong(get64(r + F_BORN)));
    SET(9, PyLong_FromUnsignedLongLong(get64(r + F_STORE)));
    {
        char hex[24];
        snprintf(hex, sizeof hex, "%016llX", (unsigned long long)phys_offset);
        PyObject *h = PyUnicode_FromStringAndSize(hex, (Py_ssize_t)strlen(hex));
        if (h == NULL) goto fail;
        v = PyUnicode_Concat(ident, h);
        Py_DECREF(h);
        if (v == NULL) goto fail;
        PyTuple_SET_ITEM(sm, 10, v);
    }
#undef SET
    if (SM_untrack) PyObject_GC_UnTrack(sm);
    return sm;
fail:
    Py_DECREF(sm);   /* unset items are NULL: tuple dealloc skips them */
    return NULL;
}

static int reader_ready(void) {
    if (SM_type == NULL || R_HEADER_SIZE < 0) {
        PyErr_SetString(PyExc_RuntimeError, "lmqtt.store._append.configure_reader() was not called or failed");
        return 0;
    }
    return 1;
}

static PyObject *decode(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"buf", "pos", "phys_offset", "ident", "verify", "end", NULL};
    PyObject *bufo, *phys_o, *ident, *end_o = Py_None;
    Py_ssize_t pos;
    int verify = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OnO!U|pO", kwlist, &bufo, &pos, &PyLong_Type, &phys_o, &ident,
                                     &verify, &end_o))
        return NULL;
    if (!reader_ready()) return NULL;
    long long phys = PyLong_AsLongLong(phys_o);
    if (phys == -1 && PyErr_Occurred()) return NULL;
    Py_buffer b;
    if (PyObject_GetBuffer(bufo, &b, PyBUF_SIMPLE) < 0) return NULL;
    Py_ssize_t limit = b.len;
    if (end_o != Py_None) {
        Py_ssize_t e = PyLong_AsSsize_t(end_o);
        if (e == -1 && PyErr_Occurred()) { PyBuffer_Release(&b); return NULL; }
        if (e < limit) limit = e;
    }
    dshare sh = {0};
    PyObject *r = decode_at(b.buf, limit, pos, phys_o, phys, ident, verify, &sh);
    dshare_clear(&sh);
    PyBuffer_Release(&b);
    return r;
}

static PyObject *decode_many(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"buf", "base", "wanted", "i", "ident", "out", "verify", NULL};
    PyObject *bufo, *wanted, *ident, *out;
    long long base;
    Py_ssize_t i;
    int verify = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OLO!nUO!|p", kwlist, &bufo, &base, &PyList_Type, &wanted, &i,
                                     &ident, &PyList_Type, &out, &verify))
        return NULL;
    if (!reader_ready()) return NULL;
    Py_buffer b;
    if (PyObject_GetBuffer(bufo, &b, PyBUF_SIMPLE) < 0) return NULL;
    dshare sh = {0};
    int failed = 0;
    Py_ssize_t n = PyList_GET_SIZE(wanted);
    for (; i < n; i++) {
        PyObject *w = PyList_GET_ITEM(wanted, i);
        if (!PyTuple_Check(w) || PyTuple_GET_SIZE(w) != 2) {
            PyErr_SetString(PyExc_TypeError, "decode_many: wanted items must be (phys, size) tuples");
            failed = 1;
            break;
        }
        PyObject *phys_o = PyTuple_GET_ITEM(w, 0);
        long long phys = PyLong_AsLongLong(phys_o);
        long long size = phys == -1 && PyErr_Occurred() ? -1 : PyLong_AsLongLong(PyTuple_GET_ITEM(w, 1));
        if (PyErr_Occurred()) { failed = 1; break; }
        long long rel = phys - base;
        if (rel < 0 || rel >= b.len) break;          /* another segment's: the caller goes on there */
        PyObject *m;
        if (size < R_HEADER_SIZE || rel + size > b.len) {
            corrupt("no valid record at offset %lld (size field %lld)", phys, size);
            m = NULL;
        } else {
            m = decode_at(b.buf, (Py_ssize_t)(rel + size), (Py_ssize_t)rel, phys_o, phys, ident, verify, &sh);
        }
        if (m == NULL) {
            /* an Exception is handed over as the item; anything else (KeyboardInterrupt) propagates */
            if (!PyErr_ExceptionMatches(PyExc_Exception)) { failed = 1; break; }
            PyObject *et, *ev, *tb;
            PyErr_Fetch(&et, &ev, &tb);
            PyErr_NormalizeException(&et, &ev, &tb);
            if (tb != NULL) PyException_SetTraceback(ev, tb);
            Py_XDECREF(et);
            Py_XDECREF(tb);
            m = ev;
            if (m == NULL) { failed = 1; break; }
        }
        int r = PyList_Append(out, m);
        Py_DECREF(m);
        if (r < 0) { failed = 1; break; }
    }
    dshare_clear(&sh);
    PyBuffer_Release(&b);
    if (failed) return NULL;
    return PyLong_FromSsize_t(i);
}

/* decode_runs(body, runs, sizes, first, ident) -> list of StoredMessage, or None
 *
 * gateway/storage/remote_entries.py `decode_raw_entries_py` in C (its reference; tests/gateway/
 * test_remote_entries_accel.py and tests/fuzz/fuzz_pushed.py compare the two): the records of one
 * queue of an OP_PUSH_RAW frame, as store/protocol.py `decode_push_raw` gives them (`runs` of
 * (phys, count, start, end), `sizes` the records' sizes in order), decoded and CRC-checked with
 * the light queue's offsets first, first + 1, ... in place of each record's own queue offset.
 * None when any record fails its checks, when a run's records do not lie in its bytes, or when a
 * run with records starts outside [0, MAX_RUN_PHYS] (offsets past 2**63 - 2**33 are never
 * written; the bound keeps every offset of a run within a C long long). Counts are never negative
 * (u32 on the wire): a negative one raises ValueError.
 *
 * Why: a `serve --workers 2` gateway whose subscriber takes what the other gateway's publishers
 * send decodes every message the store pushes; the Python loop around decode_many (a (phys, size)
 * tuple per record, a type check, a StoredMessage rebuilt to set its queue offset) was ~29 % of
 * that gateway's samples in a QoS 0 fan-in (py-spy), more than its deliveries. Here it is one pass,
 * and the messages are handed over untracked by the collector, as decode_many's are. */
#define MAX_RUN_PHYS (LLONG_MAX - (1LL << 33) + 1)     /* 2**63 - 2**33 */

static PyObject *decode_runs(PyObject *self, PyObject *args) {
    PyObject *bufo, *runs, *sizes, *first_o, *ident;
    if (!PyArg_ParseTuple(args, "OOOO!U", &bufo, &runs, &sizes, &PyLong_Type, &first_o, &ident)) return NULL;
    if (!reader_ready()) return NULL;
    PyObject *rf = PySequence_Fast(runs, "decode_runs: runs must be a sequence");
    if (rf == NULL) return NULL;
    PyObject *sf = PySequence_Fast(sizes, "decode_runs: sizes must be a sequence");
    if (sf == NULL) { Py_DECREF(rf); return NULL; }
    Py_buffer b;
    if (PyObject_GetBuffer(bufo, &b, PyBUF_SIMPLE) < 0) { Py_DECREF(rf); Py_DECREF(sf); return NULL; }
    PyObject *out = PyList_New(0);
    dshare sh = {0};
    int refused = 0;
    Py_ssize_t nsizes = PySequence_Fast_GET_SIZE(sf), k = 0, nruns = PySequence_Fast_GET_SIZE(rf);
    /* the queue offsets: first + i in a long long, or (a first offset near 2**63 or past it: the
     * wire carries a u64) added as Python ints, as the reference does */
    int big = 0;
    long long first = PyLong_AsLongLongAndOverflow(first_o, &big), qoff = 0;
    if (first == -1 && PyErr_Occurred()) Py_CLEAR(out);
    else if (big || first < LLONG_MIN + 1 || first > LLONG_MAX - nsizes) big = 1;
    for (Py_ssize_t ri = 0; out != NULL && !refused && ri < nruns; ri++) {
        PyObject *run = PySequence_Fast(PySequence_Fast_GET_ITEM(rf, ri), "decode_runs: a run must be a sequence");
        if (run == NULL) { Py_CLEAR(out); break; }
        if (PySequence_Fast_GET_SIZE(run) != 4) {
            PyErr_SetString(PyExc_ValueError, "decode_runs: a run is (phys, count, start, end)");
            Py_DECREF(run);
            Py_CLEAR(out);
            break;
        }
        int ovf = 0;
        long long phys = PyLong_AsLongLongAndOverflow(PySequence_Fast_GET_ITEM(run, 0), &ovf);
        Py_ssize_t count = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(run, 1));
        Py_ssize_t start = count == -1 && PyErr_Occurred() ? -1 : PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(run, 2));
        Py_ssize_t end = PyErr_Occurred() ? -1 : PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(run, 3));
        Py_DECREF(run);
        if (PyErr_Occurred()) { Py_CLEAR(out); break; }
        if (count < 0) {
            PyErr_SetString(PyExc_ValueError, "decode_runs: a run's record count is negative");
            Py_CLEAR(out);
            break;
        }
        if (count == 0) continue;      /* nothing to decode, whatever its offsets */
        if (ovf || phys < 0 || phys > MAX_RUN_PHYS) { refused = 1; break; }
        /* body[start:end], as Python slices it; the run's offsets stay below 2**63 since n < 2**33 */
        Py_ssize_t n = PySlice_AdjustIndices(b.len, &start, &end, 1);
        const unsigned char *seg = (const unsigned char *)b.buf + start;
        long long rel = 0;
        for (Py_ssize_t j = 0; j < count; j++, k++) {
            if (k >= nsizes || rel >= n) { refused = 1; break; }   /* fewer records than the run says */
            long long size = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(sf, k));
            if (size == -1 && PyErr_Occurred()) { Py_CLEAR(out); break; }
            if (size < R_HEADER_SIZE || rel + size > n) { refused = 1; break; }
            PyObject *phys_o = PyLong_FromLongLong(phys + rel);
            if (phys_o == NULL) { Py_CLEAR(out); break; }
            PyObject *m = decode_at(seg, (Py_ssize_t)(rel + size), (Py_ssize_t)rel, phys_o, phys + rel, ident, 1, &sh);
            Py_DECREF(phys_o);
            if (m == NULL) {
                if (PyErr_ExceptionMatches(PyExc_Exception)) { PyErr_Clear(); refused = 1; }
                else Py_CLEAR(out);
                break;
            }
            PyObject *q;
            if (!big) {
                q = PyLong_FromLongLong(first + qoff);
            } else {
                PyObject *i_o = PyLong_FromLongLong(qoff);
                q = i_o == NULL ? NULL : PyNumber_Add(first_o, i_o);
                Py_XDECREF(i_o);
            }
            qoff++;
            if (q == NULL) { Py_DECREF(m); Py_CLEAR(out); break; }
            Py_SETREF(((PyTupleObject *)m)->ob_item[5], q);
            int r = PyList_Append(out, m);
            Py_DECREF(m);
            if (r < 0) { Py_CLEAR(out); break; }
            rel += size;
        }
    }
    dshare_clear(&sh);
    PyBuffer_Release(&b);
    Py_DECREF(rf);
    Py_DECREF(sf);
    if (out == NULL) return NULL;
    if (refused) { Py_DECREF(out); Py_RETURN_NONE; }
    return out;
}

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS,
     "configure(DispatchRequest, InvalidMessage, check_size, Message, layout): see store/encoding.py"},
    {"encode", encode, METH_VARARGS, "encode a batch of messages into CommitLog records (see module doc)"},
    {"crc32", py_crc32, METH_VARARGS, "crc32(data, start=0): zlib-compatible CRC-32"},
    {"configure_reader", configure_reader, METH_VARARGS,
     "configure_reader(StoredMessage, CorruptRecord, layout): see store/record.py"},
    {"decode", (PyCFunction)(void (*)(void))decode, METH_VARARGS | METH_KEYWORDS,
     "decode(buf, pos, phys_offset, ident, verify=True, end=None): store.record.decode in C"},
    {"decode_many", (PyCFunction)(void (*)(void))decode_many, METH_VARARGS | METH_KEYWORDS,
     "decode_many(buf, base, wanted, i, ident, out, verify=True): store.record.decode_many in C"},
    {"decode_runs", decode_runs, METH_VARARGS,
     "decode_runs(body, runs, sizes, first, ident): a raw PUSH queue's records (gateway/storage/remote_entries.py)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "lmqtt.store._append",
                                    "C accelerator for store.encoding.encode_py and store.record.decode (optional)", -1, methods};

PyMODINIT_FUNC PyInit__append(void) {
    const uint16_t one = 1;
    if (*(const unsigned char *)&one != 1) {
        PyErr_SetString(PyExc_ImportError, "lmqtt.store._append supports little-endian platforms only");
        return NULL;
    }
    crc_init();
#define INTERN(v, s) if ((v = PyUnicode_InternFromString(s)) == NULL) return NULL
    INTERN(s_topic, "topic"); INTERN(s_body, "body"); INTERN(s_queue_id, "queue_id");
    INTERN(s_flags, "flags"); INTERN(s_props, "props"); INTERN(s_keys, "keys");
    INTERN(s_born_ts, "born_ts"); INTERN(s_dq, "dispatch_queues");
    INTERN(s_topic_info, "_topic_info"); INTERN(s_dq_info, "_dq_info"); INTERN(s_names, "_names");
    INTERN(s_keys_what, "keys"); INTERN(s_dq_what, "dispatch_queues");
    if ((s_nul = PyUnicode_FromStringAndSize("\0", 1)) == NULL) return NULL;
    return PyModule_Create(&moddef);
}
