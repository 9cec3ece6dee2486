/* lmqtt.store._fastpath: the per-entry loops of store/fastpath.py's `read_raw` in C.
 *
 * Why: under `lmqtt bench spark` and `lmqtt bench sdk --cases pull` the store serves raw pulls
 * (the CommitLog's record bytes as stored, docs/protocol.md) and py-spy put ~80 % of its main
 * thread in read_raw's two Python loops: per ConsumeQueue entry a tuple and a few comparisons to
 * group adjacent records into runs, and per record a memoryview slice and a zlib.crc32 call to
 * check it before sending it (~1.2 us of store CPU per 100-byte record). Here each loop is one
 * call per ConsumeQueue piece / per run.
 *
 * Both functions have Python references in store/fastpath.py (`cq_runs_py`, `check_records_py`)
 * that tests compare them with on arbitrary input (tests/store/test_fastpath_accel.py).
 *
 * dispatch_scan (below) is the dispatch round's record scan (store/dispatch.py `dispatch_round`,
 * whose Python loop is its reference; tests/store/test_dispatch_scan_accel.py compares them): a
 * replica dispatches everything it holds by parsing its CommitLog, and that loop was most of a
 * replica's CPU under `lmqtt bench ha --cases append-replicated` (BENCHMARKS.md). configure() also
 * takes, for it, the DispatchRequest type (its _fields checked), the key separator and MSG_MAGIC,
 * and checks the whole record header (it reads every field).
 *
 * cq_entries (below) packs the ConsumeQueue entries of a run of records (store/consume_queue_entries.py
 * `_entries`, its reference), which every store process's dispatch does per record.
 *
 * configure(layout) must succeed first (store/fastpath.py calls it at import, with
 * `fastpath.C_LAYOUT`): the ConsumeQueue entry format, field names and size (store/consume_queue_entries.py
 * ENTRY, ENTRY_FIELDS), and the record header format and field names (store/record.py HEADER,
 * HEADER_FIELDS). They are checked against the fields these loops read (offset, width and name;
 * the tables below and store/_layout.h) and a mismatch raises ValueError naming the field, so a
 * layout change on the Python side cannot make these loops read the wrong bytes; until a
 * configure() succeeds both functions raise RuntimeError. The magic number and CRC start are handed in by
 * the caller on every check_records call (store/record.py), not compiled in.
 *
 *   cq_runs(piece, first_qoff, visible, max_bytes, count, total, big_endian=False)
 *       piece: ConsumeQueue entries (phys u64, size u32, tags u64, little-endian; ENTRY_SIZE each);
 *       with big_endian, the same fields big-endian: the light-queue index's entries (phys, size,
 *       store ts; lightqueue/take.py ENTRY, which lightqueue/light_queue_store.py checks is this
 *       layout in the other byte order), for a push of a light queue's new entries.
 *       Walks them in order, skipping unwritten entries (size 0), and stops before the first
 *       entry at or past `visible` or the first that would take `total` past `max_bytes` (0 = no
 *       limit; never before the first record of the read, i.e. while `count` is 0).
 *       -> (runs, count, total, next_qoff, stopped): runs = [[first phys, sizes, bytes]] where
 *       sizes is a bytes object of the native u32 sizes of records adjacent in the CommitLog and
 *       bytes their sum; count/total
 *       carried on; next_qoff = queue offset after the last entry taken (-1: none taken);
 *       stopped = True when it stopped before the end of the piece.
 *
 *   check_records(chunk, sizes, magic, crc_start) -> bool
 *       chunk holds records back to back with these sizes (native u32); True when each one's
 *       head says that size and `magic`, and its CRC-32 (zlib) over [crc_start, size) matches.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <zlib.h>

#include "_layout.h"

/* What these loops read, checked by configure() against the Python definitions. */
#define ENTRY_SIZE 20   /* a ConsumeQueue entry, <QIQ (store/consume_queue_entries.py ENTRY), checked by configure() */
enum { E_PHYS = 0, E_SIZE = 8, E_TAGS = 12 };                   /* its fields */

static const field_t entry_fields[] = {{"phys_offset", E_PHYS, 8}, {"size", E_SIZE, 4}, {"tags_code", E_TAGS, 8}};
/* a record's first fields, all check_records reads: the first N_PREFIX_FIELDS of store/_layout.h's
 * record_head_fields (total_size, magic, crc; store/record.py HEADER), ending at PREFIX_END */
#define N_PREFIX_FIELDS 3
#define PREFIX_END F_QID
_Static_assert(E_TAGS + 8 == ENTRY_SIZE, "entry_fields end at ENTRY_SIZE");
_Static_assert(F_CRC + 4 == PREFIX_END, "the prefix ends after the CRC");

static int configured = 0;     /* set by configure(); cq_runs and check_records refuse to run before */

static int not_configured(void) {
    if (configured) return 0;
    PyErr_SetString(PyExc_RuntimeError, "lmqtt.store._fastpath.configure() was not called or failed "
                    "(store/fastpath.py configures it at import)");
    return -1;
}

static inline uint64_t le64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

static inline uint32_t le32(const unsigned char *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

static inline uint64_t be64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v = (v << 8) | p[i];
    return v;
}

static inline uint32_t be32(const unsigned char *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | (uint32_t)p[3];
}

/* close the current run: append [phys, sizes bytes, run bytes] to runs */
static int flush_run(PyObject *runs, unsigned long long phys, unsigned long long end, uint32_t *sizes,
                     Py_ssize_t n) {
    if (n == 0) return 0;
    PyObject *b = PyBytes_FromStringAndSize((const char *)sizes, n * (Py_ssize_t)sizeof(uint32_t));
    if (!b) return -1;
    PyObject *p = PyLong_FromUnsignedLongLong(phys);
    PyObject *len = PyLong_FromUnsignedLongLong(end - phys);
    PyObject *run = PyList_New(3);
    if (!p || !len || !run) { Py_DECREF(b); Py_XDECREF(p); Py_XDECREF(len); Py_XDECREF(run); return -1; }
    PyList_SET_ITEM(run, 0, p);
    PyList_SET_ITEM(run, 1, b);
    PyList_SET_ITEM(run, 2, len);
    int rc = PyList_Append(runs, run);
    Py_DECREF(run);
    return rc;
}

static PyObject *cq_runs(PyObject *self, PyObject *args) {
    Py_buffer piece;
    long long first_qoff, count, next_qoff = -1;
    unsigned long long visible, max_bytes, total;
    int big_endian = 0;
    if (!PyArg_ParseTuple(args, "y*LKKLK|p", &piece, &first_qoff, &visible, &max_bytes, &count, &total,
                          &big_endian))
        return NULL;
    if (not_configured() < 0) {
        PyBuffer_Release(&piece);
        return NULL;
    }
    Py_ssize_t n = piece.len / ENTRY_SIZE;
    const unsigned char *p = piece.buf;
    uint32_t *sizes = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(uint32_t));
    PyObject *runs = PyList_New(0);
    if (!sizes || !runs) {
        PyMem_Free(sizes);
        Py_XDECREF(runs);
        PyBuffer_Release(&piece);
        return PyErr_NoMemory();
    }
    Py_ssize_t in_run = 0;
    unsigned long long run_phys = 0, run_end = 0;
    int stopped = 0, ends_past_u64 = 0;   /* the run's last record ends past 2**64: nothing continues it */
    for (Py_ssize_t i = 0; i < n; i++) {
        const unsigned char *e = p + i * ENTRY_SIZE;
        unsigned long long phys = big_endian ? be64(e + E_PHYS) : le64(e + E_PHYS);
        uint32_t size = big_endian ? be32(e + E_SIZE) : le32(e + E_SIZE);
        if (size == 0) continue;                            /* not written */
        if (phys >= visible || (max_bytes && count && total + size > max_bytes)) {
            stopped = 1;
            break;
        }
        if (!in_run || ends_past_u64 || phys != run_end) {
            if (flush_run(runs, run_phys, run_end, sizes, in_run) < 0) goto fail;
            in_run = 0;
            run_phys = phys;
        }
        sizes[in_run++] = size;
        run_end = phys + size;                              /* wraps past 2**64 (the run's byte count does not) */
        ends_past_u64 = run_end < phys;
        total += size;
        count++;
        next_qoff = first_qoff + i + 1;
    }
    if (flush_run(runs, run_phys, run_end, sizes, in_run) < 0) goto fail;
    PyMem_Free(sizes);
    PyBuffer_Release(&piece);
    return Py_BuildValue("(NLKLO)", runs, count, total, next_qoff, stopped ? Py_True : Py_False);
fail:
    PyMem_Free(sizes);
    Py_DECREF(runs);
    PyBuffer_Release(&piece);
    return NULL;
}

static PyObject *check_records(PyObject *self, PyObject *args) {
    Py_buffer chunk, sizes;
    unsigned int magic, crc_start;
    if (!PyArg_ParseTuple(args, "y*y*II", &chunk, &sizes, &magic, &crc_start)) return NULL;
    if (not_configured() < 0) {
        PyBuffer_Release(&chunk);
        PyBuffer_Release(&sizes);
        return NULL;
    }
    const unsigned char *c = chunk.buf;
    const unsigned char *s = sizes.buf;
    Py_ssize_t n = sizes.len / (Py_ssize_t)sizeof(uint32_t);
    Py_ssize_t a = 0;
    int ok = 1;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t size;
        memcpy(&size, s + i * sizeof(uint32_t), sizeof(uint32_t));
        if (size < PREFIX_END || size < crc_start || a + (Py_ssize_t)size > chunk.len) { ok = 0; break; }
        const unsigned char *r = c + a;
        if (le32(r + F_TOTAL) != size || le32(r + F_MAGIC) != magic ||
            (uint32_t)crc32(0L, r + crc_start, (uInt)(size - crc_start)) != le32(r + F_CRC)) {
            ok = 0;
            break;
        }
        a += size;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&chunk);
    PyBuffer_Release(&sizes);
    return PyBool_FromLong(ok);
}


/* ------------------------------------------------------------------ cq_entries */
static inline void put_le64(unsigned char *p, uint64_t v) {
    for (int i = 0; i < 8; i++) { p[i] = (unsigned char)(v & 0xFF); v >>= 8; }
}
static inline void put_le32(unsigned char *p, uint32_t v) {
    for (int i = 0; i < 4; i++) { p[i] = (unsigned char)(v & 0xFF); v >>= 8; }
}

/* cq_entries(phys, sizes, i0, i1, tags) -> bytes
 *     The ConsumeQueue entries (<QIQ: phys_offset, size, tags_code; E_* above, checked by
 *     configure()) of records sizes[i0:i1] back to back in the CommitLog from `phys`, sharing one
 *     tag hash: store/consume_queue_entries.py `_entries` (the Python body there is the reference;
 *     tests/store/test_fastpath_accel.py compares them). Why: py-spy --gil of a replica under
 *     `lmqtt bench ha --cases append-replicated` put `_entries` at ~35 of 317 GIL samples (a list
 *     of 3 ints per record, accumulate, one Struct.pack), and a replica dispatches every record.
 *     Sizes must be ints in [0, 2**32), phys and tags must fit 64 bits (OverflowError). */
static PyObject *cq_entries(PyObject *self, PyObject *args) {
    PyObject *phys_o, *sizes, *tags_o;
    Py_ssize_t i0, i1;
    if (!PyArg_ParseTuple(args, "O!O!nnO!", &PyLong_Type, &phys_o, &PyList_Type, &sizes, &i0, &i1, &PyLong_Type,
                          &tags_o))
        return NULL;
    if (not_configured() < 0) return NULL;
    Py_ssize_t ns = PyList_GET_SIZE(sizes);
    if (i0 < 0) i0 = 0;
    if (i1 > ns) i1 = ns;
    if (i1 <= i0) return PyBytes_FromStringAndSize(NULL, 0);
    unsigned long long phys = PyLong_AsUnsignedLongLong(phys_o);
    if (phys == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    unsigned long long tags = PyLong_AsUnsignedLongLong(tags_o);
    if (tags == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    PyObject *out = PyBytes_FromStringAndSize(NULL, (i1 - i0) * ENTRY_SIZE);
    if (out == NULL) return NULL;
    unsigned char *e = (unsigned char *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = i0; i < i1; i++, e += ENTRY_SIZE) {
        PyObject *o = PyList_GET_ITEM(sizes, i);
        if (!PyLong_Check(o)) {
            Py_DECREF(out);
            PyErr_SetString(PyExc_TypeError, "cq_entries: record sizes must be ints");
            return NULL;
        }
        unsigned long long v = PyLong_AsUnsignedLongLong(o);
        if (v == (unsigned long long)-1 && PyErr_Occurred()) { Py_DECREF(out); return NULL; }
        if (v > 0xFFFFFFFFULL) {
            Py_DECREF(out);
            PyErr_SetString(PyExc_OverflowError, "cq_entries: a record size does not fit 32 bits");
            return NULL;
        }
        put_le64(e + E_PHYS, (uint64_t)phys);
        put_le32(e + E_SIZE, (uint32_t)v);
        put_le64(e + E_TAGS, (uint64_t)tags);
        unsigned long long next = phys + v;
        if (next < phys && i + 1 < i1) {
            Py_DECREF(out);
            PyErr_SetString(PyExc_OverflowError, "cq_entries: a record's phys offset does not fit 64 bits");
            return NULL;
        }
        phys = next;
    }
    return out;
}


/* ------------------------------------------------------------------ dispatch_scan */
static PyObject *DR_type;          /* store.message.DispatchRequest (a tuple subclass), from configure() */
static PyObject *SEP_str;          /* store.record.SEP, the separator of keys and dispatch queues */
static uint32_t DS_MSG_MAGIC;      /* store.record.MSG_MAGIC */
/* the DispatchRequest fields in the order the scan fills them: dr_fields in store/_layout.h */

static inline uint16_t le16(const unsigned char *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

/* cache[b] (a borrowed reference), else decoded (UTF-8) and, for `split`, split on SEP into a tuple,
 * stored in cache (cleared first past 100,000 entries) and returned borrowed. NULL with an error set,
 * or NULL without one when the bytes are not UTF-8 (the caller hands the record back to Python,
 * which raises as the reference does). */
static PyObject *cached_decode(PyObject *cache, PyObject *b, int split) {
    PyObject *v = PyDict_GetItemWithError(cache, b);
    if (v != NULL || PyErr_Occurred()) return v;
    PyObject *s = PyUnicode_DecodeUTF8(PyBytes_AS_STRING(b), PyBytes_GET_SIZE(b), NULL);
    if (s == NULL) {
        if (PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) PyErr_Clear();
        return NULL;
    }
    if (split) {
        PyObject *l = PyUnicode_Split(s, SEP_str, -1);
        Py_DECREF(s);
        if (l == NULL) return NULL;
        s = PyList_AsTuple(l);
        Py_DECREF(l);
        if (s == NULL) return NULL;
    }
    if (PyDict_GET_SIZE(cache) > 100000) PyDict_Clear(cache);
    int rc = PyDict_SetItem(cache, b, s);
    Py_DECREF(s);                       /* the cache holds it */
    return rc < 0 ? NULL : s;
}

/* dispatch_scan(mm, rel, soft, hard, bad_rel, max_batch, sizes, starts, runs, tcache, ncache, state)
 *     The loop of store/dispatch.py's `Dispatcher.dispatch_round` (its Python reference, kept there)
 *     over the records of `mm` from `rel`: appends to sizes / starts / runs exactly what that loop
 *     appends, through the same topic and dispatch-queue caches, and stops where it would stop
 *     (rel >= soft, max_batch records, rel == bad_rel: a corrupt range, which Python skips) or
 *     before any record it leaves to Python: a record that does not end within `hard` (the
 *     committed end in this segment: on a replica, the shipped bytes may end inside a record,
 *     whose rest is not there yet; nothing at or past `hard` is read) or the buffer,
 *     a magic other than MSG_MAGIC (a blank filler ends the segment there; anything else raises),
 *     a topic / keys / dispatch queues past the buffer or not UTF-8, a total_size below the head.
 *     state: the open run as the Python loop keeps it, (r_tb, r_qid, r_qoff, r_phys, r_flags,
 *     r_born, r_sts, r_tags, r_db, r_dlen), r_tb None when no run can be continued.
 *     -> (rel, keyed, state): where it stopped, whether a record with keys was taken, the open run. */
static PyObject *dispatch_scan(PyObject *self, PyObject *args) {
    Py_buffer mm;
    Py_ssize_t rel, soft, hard, bad_rel, max_batch;
    PyObject *sizes, *starts, *runs, *tcache, *ncache, *state;
    if (!PyArg_ParseTuple(args, "y*nnnnnO!O!O!O!O!O!", &mm, &rel, &soft, &hard, &bad_rel, &max_batch,
                          &PyList_Type, &sizes, &PyList_Type, &starts, &PyList_Type, &runs, &PyDict_Type, &tcache,
                          &PyDict_Type, &ncache, &PyTuple_Type, &state))
        return NULL;
    if (not_configured() < 0 || DR_type == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "dispatch_scan: not configured");
        PyBuffer_Release(&mm);
        return NULL;
    }
    if (PyTuple_GET_SIZE(state) != 10) {
        PyBuffer_Release(&mm);
        PyErr_SetString(PyExc_ValueError, "dispatch_scan: state is not a 10-tuple");
        return NULL;
    }
    const unsigned char *buf = mm.buf;
    Py_ssize_t lim = hard < mm.len ? hard : mm.len;     /* nothing past either is read */
    /* the open run, from state: open = r_tb is bytes and every field fits (else none can continue it) */
    int open = 0, changed = 0, keyed = 0;
    uint64_t r_qid = 0, r_qoff = 0, r_phys = 0, r_flags = 0, r_born = 0, r_sts = 0, r_tags = 0, r_dlen = 0;
    PyObject *r_tb = NULL, *r_db = NULL;    /* owned */
    {
        PyObject *tb = PyTuple_GET_ITEM(state, 0), *db = PyTuple_GET_ITEM(state, 8);
        if (PyBytes_Check(tb) && PyBytes_Check(db)) {
            uint64_t v[8];
            int idx[8] = {1, 2, 3, 4, 5, 6, 7, 9};
            open = 1;
            for (int i = 0; i < 8 && open; i++) {
                v[i] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(state, idx[i]));
                if (v[i] == (uint64_t)-1 && PyErr_Occurred()) {
                    PyErr_Clear();
                    open = 0;
                }
            }
            if (open) {
                r_qid = v[0]; r_qoff = v[1]; r_phys = v[2]; r_flags = v[3];
                r_born = v[4]; r_sts = v[5]; r_tags = v[6]; r_dlen = v[7];
                r_tb = Py_NewRef(tb);
                r_db = Py_NewRef(db);
            }
        }
    }
    while (rel < soft) {
        if (PyList_GET_SIZE(sizes) >= max_batch || rel == bad_rel) break;
        if (rel < 0 || rel + F_END > lim) break;                    /* Python: blank filler or error */
        const unsigned char *h = buf + rel;
        uint32_t total = le32(h + F_TOTAL);
        if (le32(h + F_MAGIC) != DS_MSG_MAGIC || total < F_END) break;
        if ((Py_ssize_t)total > lim - rel) break;                   /* not all here: Python waits */
        uint64_t qid = le32(h + F_QID), flags = le32(h + F_FLAGS), qoff = le64(h + F_QOFF),
                 phys = le64(h + F_PHYS), born = le64(h + F_BORN), sts = le64(h + F_STORE),
                 tags = le64(h + F_TAGS);
        Py_ssize_t tlen = le16(h + F_TOPIC_LEN), klen = le16(h + F_KEYS_LEN), dlen = le16(h + F_DQ_LEN);
        Py_ssize_t p = rel + F_END;
        if (p + tlen + klen + dlen > lim) break;                    /* Python slices what there is */
        const unsigned char *tp = buf + p, *dp = buf + p + tlen + klen;
        if (open && qoff == r_qoff && phys == r_phys && qid == r_qid && !klen && sts == r_sts &&
            born == r_born && flags == r_flags && tags == r_tags && tlen == PyBytes_GET_SIZE(r_tb) &&
            memcmp(tp, PyBytes_AS_STRING(r_tb), (size_t)tlen) == 0 && (uint64_t)dlen == r_dlen &&
            (!dlen || (dlen == PyBytes_GET_SIZE(r_db) && memcmp(dp, PyBytes_AS_STRING(r_db), (size_t)dlen) == 0))) {
            PyObject *sz = PyLong_FromUnsignedLong(total);          /* continues the open run */
            if (sz == NULL || PyList_Append(sizes, sz) < 0) { Py_XDECREF(sz); goto fail; }
            Py_DECREF(sz);
            r_qoff = qoff + 1;
            r_phys = phys + total;
            changed = 1;
            if (r_qoff == 0 || r_phys < phys) open = 0;            /* past 2**64: nothing continues it */
            rel += total;
            continue;
        }
        /* a run starts here: decode everything first, so a record handed back leaves nothing behind
         * but cache entries the Python loop would make too */
        PyObject *tb = PyBytes_FromStringAndSize((const char *)tp, tlen);
        if (tb == NULL) goto fail;
        PyObject *topic = cached_decode(tcache, tb, 0);
        if (topic == NULL) { Py_DECREF(tb); if (PyErr_Occurred()) goto fail; break; }
        PyObject *keys, *db, *dq;
        if (klen) {
            PyObject *kb = PyBytes_FromStringAndSize((const char *)tp + tlen, klen);
            if (kb == NULL) { Py_DECREF(tb); goto fail; }
            PyObject *ks = PyUnicode_DecodeUTF8(PyBytes_AS_STRING(kb), klen, NULL);
            Py_DECREF(kb);
            if (ks == NULL) {
                Py_DECREF(tb);
                if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) goto fail;
                PyErr_Clear();
                break;
            }
            PyObject *kl = PyUnicode_Split(ks, SEP_str, -1);
            Py_DECREF(ks);
            keys = kl ? PyList_AsTuple(kl) : NULL;
            Py_XDECREF(kl);
            if (keys == NULL) { Py_DECREF(tb); goto fail; }
        } else {
            keys = PyTuple_New(0);
        }
        if (dlen) {
            db = PyBytes_FromStringAndSize((const char *)dp, dlen);
            if (db == NULL) { Py_DECREF(tb); Py_DECREF(keys); goto fail; }
            dq = cached_decode(ncache, db, 1);
            if (dq == NULL) {
                Py_DECREF(tb); Py_DECREF(keys); Py_DECREF(db);
                if (PyErr_Occurred()) goto fail;
                break;
            }
            Py_INCREF(dq);
        } else {
            db = PyBytes_FromStringAndSize(NULL, 0);
            dq = PyTuple_New(0);
        }
        PyObject *r = ((PyTypeObject *)DR_type)->tp_alloc((PyTypeObject *)DR_type, N_DR_FIELDS);
        PyObject *st = PyLong_FromSsize_t(PyList_GET_SIZE(sizes));
        PyObject *sz = PyLong_FromUnsignedLong(total);
        PyObject *items[11] = {PyLong_FromUnsignedLongLong(phys), Py_NewRef(sz), Py_NewRef(topic),
                               PyLong_FromUnsignedLongLong(qid), PyLong_FromUnsignedLongLong(qoff),
                               PyLong_FromUnsignedLongLong(flags), PyLong_FromUnsignedLongLong(born),
                               PyLong_FromUnsignedLongLong(sts), PyLong_FromUnsignedLongLong(tags), keys, dq};
        int bad = r == NULL || st == NULL || db == NULL;
        for (int i = 0; i < 11; i++) bad |= items[i] == NULL;
        if (bad) {
            for (int i = 0; i < 11; i++) Py_XDECREF(items[i]);
            Py_XDECREF(r); Py_XDECREF(st); Py_XDECREF(sz); Py_XDECREF(db); Py_DECREF(tb);
            goto fail;
        }
        for (int i = 0; i < 11; i++) PyTuple_SET_ITEM(r, i, items[i]);
        int rc = PyList_Append(starts, st) < 0 || PyList_Append(runs, r) < 0 || PyList_Append(sizes, sz) < 0;
        Py_DECREF(st); Py_DECREF(r); Py_DECREF(sz);
        if (rc) { Py_DECREF(tb); Py_DECREF(db); goto fail; }
        changed = 1;
        if (klen) {
            keyed = 1;
            open = 0;                   /* a record with keys is a run of its own */
            Py_DECREF(tb); Py_DECREF(db);
        } else {
            Py_XSETREF(r_tb, tb);
            Py_XSETREF(r_db, db);
            r_qid = qid; r_qoff = qoff + 1; r_phys = phys + total; r_flags = flags;
            r_born = born; r_sts = sts; r_tags = tags; r_dlen = (uint64_t)dlen;
            open = r_qoff != 0 && r_phys >= phys;
        }
        rel += total;
    }
    PyBuffer_Release(&mm);
    PyObject *out_state;
    if (!changed)
        out_state = Py_NewRef(state);
    else if (open)
        out_state = Py_BuildValue("(OKKKKKKKOK)", r_tb, (unsigned long long)r_qid, (unsigned long long)r_qoff,
                                  (unsigned long long)r_phys, (unsigned long long)r_flags,
                                  (unsigned long long)r_born, (unsigned long long)r_sts,
                                  (unsigned long long)r_tags, r_db, (unsigned long long)r_dlen);
    else
        out_state = Py_BuildValue("(OiiiiiiiyI)", Py_None, -1, -1, -1, -1, -1, -1, -1, "", 0u);
    Py_XDECREF(r_tb);
    Py_XDECREF(r_db);
    if (out_state == NULL) return NULL;
    return Py_BuildValue("(nON)", rel, keyed ? Py_True : Py_False, out_state);
fail:
    Py_XDECREF(r_tb);
    Py_XDECREF(r_db);
    PyBuffer_Release(&mm);
    return NULL;
}


/* ------------------------------------------------------------------ configuration */
#define READS "these loops read"


/* ------------------------------------------------------------------ stored ConsumeQueue blocks */
/* cq_encode(entries, big_endian=False) -> bytes and cq_decode(value, start=0, stop=-1,
 * big_endian=False) -> bytes: a ConsumeQueue block (and a light-queue index run) as the database stores it, in runs (the format, and why, in store/consume_queue_entries.py
 * "stored blocks"; `encode_block_py` and `decode_block_py` there are the references,
 * tests/store/test_cq_block_codec.py compares them on arbitrary input, damaged values included).
 * cq_decode reads bytes from disk: every length is checked before it is read, a bad value raises
 * ValueError, and it never makes more than BLOCK_MAX entries. */
#define BLOCK_TAG 0xC1
/* the light-queue index stores its entries big-endian (lightqueue/take.py ENTRY, >QIQ: the same
 * fields at the same offsets, its third the store time), the ConsumeQueue little-endian: one flag */
static inline uint64_t ld64(const unsigned char *p, int be) {
    if (!be) return le64(p);
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v = (v << 8) | p[i];
    return v;
}
static inline uint32_t ld32(const unsigned char *p, int be) {
    return be ? ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | (uint32_t)p[3] : le32(p);
}
static inline void st64(unsigned char *p, uint64_t v, int be) {
    if (!be) { put_le64(p, v); return; }
    for (int i = 7; i >= 0; i--) { p[i] = (unsigned char)(v & 0xFF); v >>= 8; }
}
static inline void st32(unsigned char *p, uint32_t v, int be) {
    if (!be) { put_le32(p, v); return; }
    for (int i = 3; i >= 0; i--) { p[i] = (unsigned char)(v & 0xFF); v >>= 8; }
}
#define BLOCK_MAX (1 << 20)     /* entries in one block at most (consume_queue_entries.BLOCK_MAX) */

static unsigned char *put_varint(unsigned char *p, uint64_t v) {
    while (v >= 0x80) { *p++ = (unsigned char)((v & 0x7F) | 0x80); v >>= 7; }
    *p++ = (unsigned char)v;
    return p;
}

/* 0 and *v, or -1 with ValueError */
static int get_varint(const unsigned char *b, Py_ssize_t len, Py_ssize_t *pos, uint64_t limit, uint64_t *v) {
    uint64_t x = 0;
    int shift = 0;
    for (;;) {
        if (*pos >= len) {
            PyErr_SetString(PyExc_ValueError, "ConsumeQueue block: truncated (a number runs past the end)");
            return -1;
        }
        unsigned c = b[(*pos)++];
        if (shift == 63 && (c & 0x7F) > 1) {
            PyErr_SetString(PyExc_ValueError, "ConsumeQueue block: a number out of range (more than 64 bits)");
            return -1;
        }
        x |= (uint64_t)(c & 0x7F) << shift;
        if (!(c & 0x80)) break;
        shift += 7;
        if (shift > 63) {
            PyErr_SetString(PyExc_ValueError, "ConsumeQueue block: a number longer than 64 bits");
            return -1;
        }
    }
    if (x > limit) {
        PyErr_Format(PyExc_ValueError, "ConsumeQueue block: %llu is out of range (at most %llu)",
                     (unsigned long long)x, (unsigned long long)limit);
        return -1;
    }
    *v = x;
    return 0;
}

static PyObject *cq_encode(PyObject *self, PyObject *args) {
    Py_buffer in;
    int be = 0;
    if (not_configured() < 0 || !PyArg_ParseTuple(args, "y*|p", &in, &be)) return NULL;
    Py_ssize_t len = in.len, n = len / ENTRY_SIZE;
    const unsigned char *e = (const unsigned char *)in.buf;
    if (n * ENTRY_SIZE != len) {
        PyErr_Format(PyExc_ValueError, "ConsumeQueue block: %zd bytes is not a whole number of entries", len);
        PyBuffer_Release(&in);
        return NULL;
    }
    if (n > BLOCK_MAX) {
        PyObject *raw = PyBytes_FromStringAndSize((const char *)e, len);
        PyBuffer_Release(&in);
        return raw;
    }
    /* a group is at most 1 + 10 + 10 + 5 + 9 bytes past the last check against len */
    unsigned char *buf = PyMem_Malloc((size_t)len + 64), *o = buf;
    if (buf == NULL) { PyBuffer_Release(&in); return PyErr_NoMemory(); }
    *o++ = BLOCK_TAG;
    o = put_varint(o, (uint64_t)n);
    uint64_t exp = 0, prev_tag = 0;
    int have_tag = 0, raw = 0;
    for (Py_ssize_t i = 0; i < n;) {
        const unsigned char *p = e + i * ENTRY_SIZE;
        uint64_t phys = ld64(p + E_PHYS, be), last = phys, tag = ld64(p + E_TAGS, be);
        uint32_t size = ld32(p + E_SIZE, be);
        Py_ssize_t j = i + 1;
        for (; j < n; j++) {
            const unsigned char *q = e + j * ENTRY_SIZE;
            if (ld32(q + E_SIZE, be) != size || ld64(q + E_TAGS, be) != tag || ld64(q + E_PHYS, be) != last + size)
                break;
            last += size;
        }
        o = put_varint(o, (uint64_t)(j - i));
        o = put_varint(o, phys - exp);
        o = put_varint(o, size);
        if (have_tag && tag == prev_tag) *o++ = 0;
        else { *o++ = 1; put_le64(o, tag); o += 8; }
        prev_tag = tag;
        have_tag = 1;
        exp = last + size;
        i = j;
        if (o - buf >= len) { raw = 1; break; }
    }
    if (!raw && (o - buf) % ENTRY_SIZE == 0) *o++ = 0;
    if (o - buf >= len) raw = 1;
    PyObject *out = raw ? PyBytes_FromStringAndSize((const char *)e, len)
                        : PyBytes_FromStringAndSize((const char *)buf, o - buf);
    PyMem_Free(buf);
    PyBuffer_Release(&in);
    return out;
}

static PyObject *cq_decode(PyObject *self, PyObject *args) {
    Py_buffer in;
    Py_ssize_t start = 0, stop = -1;
    int be = 0;
    if (not_configured() < 0 || !PyArg_ParseTuple(args, "y*|nnp", &in, &start, &stop, &be)) return NULL;
    const unsigned char *b = (const unsigned char *)in.buf;
    Py_ssize_t len = in.len;
    PyObject *out = NULL;
    if (len % ENTRY_SIZE == 0) {
        Py_ssize_t n = len / ENTRY_SIZE;
        if (start < 0) start = 0;
        if (start > n) start = n;
        stop = stop < 0 ? n : (stop < start ? start : (stop > n ? n : stop));
        out = PyBytes_FromStringAndSize((const char *)b + start * ENTRY_SIZE, (stop - start) * ENTRY_SIZE);
        PyBuffer_Release(&in);
        return out;
    }
    if (b[0] != BLOCK_TAG) {
        PyErr_Format(PyExc_ValueError, "ConsumeQueue block: unknown format %#04x (%zd bytes)", b[0], len);
        goto done;
    }
    Py_ssize_t pos = 1;
    uint64_t n64;
    if (get_varint(b, len, &pos, BLOCK_MAX, &n64) < 0) goto done;
    Py_ssize_t n = (Py_ssize_t)n64;
    if (start < 0) start = 0;
    if (start > n) start = n;
    stop = stop < 0 ? n : (stop < start ? start : (stop > n ? n : stop));
    out = PyBytes_FromStringAndSize(NULL, (stop - start) * ENTRY_SIZE);
    if (out == NULL) goto done;
    unsigned char *w = (unsigned char *)PyBytes_AS_STRING(out);
    uint64_t exp = 0, tag = 0;
    int have_tag = 0;
    for (Py_ssize_t k = 0; k < n;) {
        uint64_t run, delta, size;
        if (get_varint(b, len, &pos, UINT64_MAX, &run) < 0) goto fail;
        if (run == 0 || run > (uint64_t)(n - k)) {
            PyErr_Format(PyExc_ValueError, "ConsumeQueue block: a run of %llu entries at entry %zd of %zd",
                         (unsigned long long)run, k, n);
            goto fail;
        }
        if (get_varint(b, len, &pos, UINT64_MAX, &delta) < 0 || get_varint(b, len, &pos, 0xFFFFFFFFULL, &size) < 0)
            goto fail;
        if (pos >= len) {
            PyErr_SetString(PyExc_ValueError, "ConsumeQueue block: truncated (a run without its tag)");
            goto fail;
        }
        unsigned flag = b[pos++];
        if (flag == 1) {
            if (pos + 8 > len) {
                PyErr_SetString(PyExc_ValueError, "ConsumeQueue block: truncated (a tag hash runs past the end)");
                goto fail;
            }
            tag = le64(b + pos);
            pos += 8;
            have_tag = 1;
        } else if (flag != 0 || !have_tag) {
            PyErr_Format(PyExc_ValueError, "ConsumeQueue block: bad tag marker %u at entry %zd", flag, k);
            goto fail;
        }
        uint64_t phys = exp + delta;
        Py_ssize_t a = start > k ? start : k, z = stop < k + (Py_ssize_t)run ? stop : k + (Py_ssize_t)run;
        for (Py_ssize_t x = a; x < z; x++, w += ENTRY_SIZE) {
            st64(w + E_PHYS, phys + (uint64_t)(x - k) * size, be);
            st32(w + E_SIZE, (uint32_t)size, be);
            st64(w + E_TAGS, tag, be);
        }
        exp = phys + run * size;
        k += (Py_ssize_t)run;
    }
    if (len - pos > 1 || (len - pos == 1 && b[pos] != 0)) {
        PyErr_Format(PyExc_ValueError, "ConsumeQueue block: %zd bytes after its %zd entries", len - pos, n);
        goto fail;
    }
    goto done;
fail:
    Py_CLEAR(out);
done:
    PyBuffer_Release(&in);
    return out;
}

/* configure(layout): {"cq_entry_format": "<QIQ", "cq_entry_fields": ("phys_offset", "size",
 * "tags_code"), "cq_entry_size": 20, "record_header_format": "<IIIIIQQQQQIIHHH",
 * "record_header_fields": ("total_size", "magic", "crc", ...)} (store/fastpath.py C_LAYOUT, from
 * store/consume_queue_entries.py and store/record.py). A refused layout leaves the module unconfigured. */
static PyObject *configure(PyObject *self, PyObject *args) {
    PyObject *layout;
    long long head_size;
    if (!PyArg_ParseTuple(args, "O!", &PyDict_Type, &layout)) return NULL;
    configured = 0;
    if (check_struct(layout, "ConsumeQueue entry", "cq_entry_format", "cq_entry_size", '<', entry_fields,
                     N_FIELDS(entry_fields), ENTRY_SIZE, READS) < 0 ||
        check_names("ConsumeQueue entry", PyDict_GetItemString(layout, "cq_entry_fields"), entry_fields,
                    N_FIELDS(entry_fields), 1, READS) < 0)
        return NULL;
    const char *hf = layout_str(layout, "record_header_format");
    if (hf == NULL ||
        check_format("record header", hf, '<', record_head_fields, N_FIELDS(record_head_fields), 1, &head_size,
                     READS) < 0 ||
        check_names("record header", PyDict_GetItemString(layout, "record_header_fields"), record_head_fields,
                    N_FIELDS(record_head_fields), 1, READS) < 0)
        return NULL;
    /* dispatch_scan's: the DispatchRequest type (its fields in the order the scan fills them), the
     * separator of keys and dispatch queues, the record magic */
    PyObject *dr = PyDict_GetItemString(layout, "dispatch_request");
    PyObject *sep = PyDict_GetItemString(layout, "sep");
    long long magic;
    if (dr == NULL || !PyType_Check(dr) || !PyType_IsSubtype((PyTypeObject *)dr, &PyTuple_Type)) {
        PyErr_SetString(PyExc_ValueError, "configure: layout has no dispatch_request (a tuple subclass)");
        return NULL;
    }
    if (sep == NULL || !PyUnicode_Check(sep) || PyUnicode_GET_LENGTH(sep) != 1) {
        PyErr_SetString(PyExc_ValueError, "configure: layout has no one-character str sep");
        return NULL;
    }
    if (layout_int(layout, "msg_magic", &magic) < 0) return NULL;
    int ok = fields_match(dr, dr_fields, N_DR_FIELDS);
    if (ok < 0) return NULL;
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "configure: DispatchRequest._fields differ from the order dispatch_scan "
                        "fills (phys_offset, size, topic, queue_id, queue_offset, flags, born_ts, store_ts, "
                        "tags_code, keys, dispatch_queues)");
        return NULL;
    }
    Py_XSETREF(DR_type, Py_NewRef(dr));
    Py_XSETREF(SEP_str, Py_NewRef(sep));
    DS_MSG_MAGIC = (uint32_t)magic;
    configured = 1;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS,
     "configure(layout): ConsumeQueue entry and record header formats, checked (see module doc)"},
    {"cq_runs", cq_runs, METH_VARARGS, "ConsumeQueue entries -> runs of adjacent records (see module doc)"},
    {"check_records", check_records, METH_VARARGS, "sizes, magic and CRC of records back to back (see module doc)"},
    {"dispatch_scan", dispatch_scan, METH_VARARGS, "the dispatch round's record scan (see store/dispatch.py)"},
    {"cq_entries", cq_entries, METH_VARARGS,
     "cq_entries(phys, sizes, i0, i1, tags) -> ConsumeQueue entries of records back to back (store/consume_queue_entries.py)"},
    {"cq_encode", cq_encode, METH_VARARGS,
     "cq_encode(entries, big_endian=False) -> a block of entries as stored (store/consume_queue_entries.py)"},
    {"cq_decode", cq_decode, METH_VARARGS,
     "cq_decode(value, start=0, stop=-1, big_endian=False) -> entries [start, stop) of a stored block "
     "(store/consume_queue_entries.py)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fastpath",
    "C loops of store/fastpath.py's raw read (Python references beside them there)", -1, methods};

PyMODINIT_FUNC PyInit__fastpath(void) { return PyModule_Create(&module); }
