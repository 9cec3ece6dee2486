/* lightqueue._take: lightqueue.take.take_requests in C (optional accelerator).
 *
 * Why: with device topics every record is its own run, and indexing it in Python (unpack the
 * request, look up its resolved queues, pack a 20-byte entry, append it to the topic's tail and
 * accumulate it for the filters' tails) cost ~1.5 us of CPU per record on the store's dispatch
 * thread, which shares the GIL with the appender. This does the same, record for record; the
 * Python function (lightqueue/take.py) stays the reference and the fallback
 * (tests/lightqueue/test_lightqueue_speedups.py compares the two; LMQTT_PURE_PYTHON=1 turns this
 * off). `index` is the LightQueueIndex: its resolved dict and resolve method are called back.
 *
 * take_requests(index, batch, ckpt, touched, touched_f, mark)
 *
 * `batch` is a list of DispatchRequest tuples. A dispatch tuple not yet resolved calls
 * index.resolve(qs, phys) (which may write RocksDB and replace index.resolved), exactly where
 * the Python loop does. Tails are bytearrays grown in place, as `ba += e` does; the GIL is held
 * throughout, so a reader never sees half an entry.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Positions and sizes this loop reads and writes, handed over by configure() from
 * lightqueue/take.py (ENTRY, the RES_* slots of a resolved list) and store/message.py (the DR_*
 * positions of a DispatchRequest). Nothing is repeated here: take_requests refuses to run until
 * configure() has accepted them. */
#define ENTRY_SIZE 20   /* the only entry layout this loop packs: >QIQ, checked by configure() */
static int configured = 0;
static Py_ssize_t dr_phys, dr_size, dr_store_ts, dr_qs, dr_len;
static Py_ssize_t res_tail, res_filters, res_first, res_mark, res_others, res_len;

static PyObject *s_resolved, *s_resolve;

static inline void put_be64(unsigned char *p, uint64_t v) {
    for (int i = 7; i >= 0; i--) { p[i] = (unsigned char)(v & 0xFF); v >>= 8; }
}
static inline void put_be32(unsigned char *p, uint32_t v) {
    for (int i = 3; i >= 0; i--) { p[i] = (unsigned char)(v & 0xFF); v >>= 8; }
}

static int ba_extend(PyObject *ba, const unsigned char *data, Py_ssize_t n) {
    if (!PyByteArray_Check(ba)) {
        PyErr_SetString(PyExc_TypeError, "light-queue tail is not a bytearray");
        return -1;
    }
    Py_ssize_t len = PyByteArray_GET_SIZE(ba);
    if (PyByteArray_Resize(ba, len + n) < 0) return -1;
    memcpy(PyByteArray_AS_STRING(ba) + len, data, (size_t)n);
    return 0;
}

/* _spread: the accumulated entries to every filter tail of `cur` (a tuple of bytearrays) */
static int spread(PyObject *cur, const unsigned char *acc, Py_ssize_t n) {
    if (cur == NULL || n == 0) return 0;
    Py_ssize_t k = PyTuple_GET_SIZE(cur);
    for (Py_ssize_t i = 0; i < k; i++)
        if (ba_extend(PyTuple_GET_ITEM(cur, i), acc, n) < 0) return -1;
    return 0;
}

static PyObject *take_requests(PyObject *self, PyObject *args) {
    PyObject *index, *batch, *touched, *touched_f, *mark;
    long long ckpt;
    if (!PyArg_ParseTuple(args, "OO!LO!O!O", &index, &PyList_Type, &batch, &ckpt, &PyList_Type, &touched,
                          &PyList_Type, &touched_f, &mark))
        return NULL;
    if (!configured) {
        PyErr_SetString(PyExc_RuntimeError, "lmqtt.lightqueue._take.configure() was not called or failed");
        return NULL;
    }
    PyObject *resolved = PyObject_GetAttr(index, s_resolved);
    if (resolved == NULL) return NULL;
    PyObject *cur = NULL;       /* owned: the filter tails being accumulated */
    PyObject *c_own = NULL;     /* owned: the resolved list of the current record, after a miss */
    unsigned char *acc = NULL;
    Py_ssize_t acc_len = 0, acc_cap = 0;
    PyObject *ret = NULL;
    Py_ssize_t n = PyList_GET_SIZE(batch);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *r = PyList_GET_ITEM(batch, i);
        if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) < dr_len) {
            PyErr_SetString(PyExc_TypeError, "dispatch batch items must be DispatchRequest tuples");
            goto done;
        }
        PyObject *qs = PyTuple_GET_ITEM(r, dr_qs);
        if (!PyTuple_Check(qs)) {
            PyErr_SetString(PyExc_TypeError, "dispatch_queues must be a tuple");
            goto done;
        }
        if (PyTuple_GET_SIZE(qs) == 0) continue;
        PyObject *phys_o = PyTuple_GET_ITEM(r, dr_phys);
        long long phys = PyLong_AsLongLong(phys_o);
        if (phys == -1 && PyErr_Occurred()) goto done;
        if (phys < ckpt) continue;   /* already indexed (idempotent replay) */
        long long size = PyLong_AsLongLong(PyTuple_GET_ITEM(r, dr_size));
        if (size == -1 && PyErr_Occurred()) goto done;
        unsigned long long sts = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(r, dr_store_ts));
        if (sts == (unsigned long long)-1 && PyErr_Occurred()) goto done;
        PyObject *c = PyDict_GetItemWithError(resolved, qs);
        if (c == NULL) {
            if (PyErr_Occurred()) goto done;
            if (spread(cur, acc, acc_len) < 0) goto done;
            acc_len = 0;
            Py_XSETREF(c_own, PyObject_CallMethodObjArgs(index, s_resolve, qs, phys_o, NULL));
            if (c_own == NULL) goto done;
            c = c_own;
            Py_SETREF(resolved, PyObject_GetAttr(index, s_resolved));
            if (resolved == NULL) goto done;
        }
        if (!PyList_Check(c) || PyList_GET_SIZE(c) < res_len) {
            PyErr_SetString(PyExc_TypeError, "resolved light queues must be a list of the configured length");
            goto done;
        }
        if (PyList_GET_ITEM(c, res_mark) != mark) {
            if (PyList_SetItem(c, res_mark, Py_NewRef(mark)) < 0) goto done;
            if (PyList_Append(touched, PyList_GET_ITEM(c, res_first)) < 0) goto done;
        }
        unsigned char e[ENTRY_SIZE];
        put_be64(e, (uint64_t)phys);
        put_be32(e + 8, (uint32_t)size);
        put_be64(e + 12, (uint64_t)sts);
        PyObject *f = PyList_GET_ITEM(c, res_filters);
        if (f != cur) {
            if (spread(cur, acc, acc_len) < 0) goto done;
            acc_len = 0;
            if (!PyTuple_Check(f)) {
                PyErr_SetString(PyExc_TypeError, "filter tails must be a tuple");
                goto done;
            }
            Py_XSETREF(cur, Py_NewRef(f));
            if (PyList_Append(touched_f, PyList_GET_ITEM(c, res_others)) < 0) goto done;
        }
        if (PyTuple_GET_SIZE(cur)) {
            if (acc_len + ENTRY_SIZE > acc_cap) {
                Py_ssize_t nc = acc_cap ? acc_cap * 2 : 4096;
                unsigned char *na = realloc(acc, (size_t)nc);
                if (na == NULL) { PyErr_NoMemory(); goto done; }
                acc = na;
                acc_cap = nc;
            }
            memcpy(acc + acc_len, e, ENTRY_SIZE);
            acc_len += ENTRY_SIZE;
        }
        if (ba_extend(PyList_GET_ITEM(c, res_tail), e, ENTRY_SIZE) < 0) goto done;
        Py_CLEAR(c_own);
    }
    if (spread(cur, acc, acc_len) < 0) goto done;
    ret = Py_NewRef(Py_None);
done:
    free(acc);
    Py_XDECREF(cur);
    Py_XDECREF(c_own);
    Py_XDECREF(resolved);
    return ret;
}

typedef unsigned __int128 u128;

/* ckpt (any int) as a bound on phys offsets, which the skip loop below keeps in 128 bits: a
 * negative one is 0 (takes everything), one of 2**100 or more is saturated there (no run of
 * < 2**63 records of < 2**32 bytes from a phys < 2**64 reaches 2**100) */
static int ckpt_bound(PyObject *o, u128 *ckpt) {
    int ovf;
    *ckpt = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &ovf);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (ovf < 0 || (!ovf && v < 0)) return 0;
    if (!ovf) { *ckpt = (u128)(uint64_t)v; return 0; }
    /* past 2**63: its high 64 bits (o >> 64) and low 64 bits, through the public API only (the
     * private _PyLong_AsByteArray changed its signature in 3.13) */
    PyObject *sh = PyLong_FromLong(64);
    PyObject *hi_o = sh != NULL ? PyNumber_Rshift(o, sh) : NULL;
    Py_XDECREF(sh);
    if (hi_o == NULL) return -1;
    unsigned long long hi = PyLong_AsUnsignedLongLong(hi_o);
    Py_DECREF(hi_o);
    if (hi == (unsigned long long)-1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) return -1;
        PyErr_Clear();
        hi = ~0ULL;
    }
    if (hi >> 36) {                     /* 2**100 or more */
        *ckpt = (u128)1 << 100;
        return 0;
    }
    unsigned long long lo = PyLong_AsUnsignedLongLongMask(o);
    if (lo == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *ckpt = ((u128)hi << 64) | lo;
    return 0;
}

/* sizes[k] as a u32, or -1 with an error set */
static int size_at(PyObject *sizes, Py_ssize_t k, uint32_t *out) {
    PyObject *o = PyList_GET_ITEM(sizes, k);
    if (!PyLong_Check(o)) {
        PyErr_SetString(PyExc_TypeError, "run_entries: record sizes must be ints");
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    if (v > 0xFFFFFFFFULL) {
        PyErr_SetString(PyExc_OverflowError, "run_entries: a record size does not fit 32 bits");
        return -1;
    }
    *out = (uint32_t)v;
    return 0;
}

static PyObject *no_entries(void) { return Py_BuildValue("(yi)", "", -1); }

static PyObject *phys_overflow(void) {
    PyErr_SetString(PyExc_OverflowError, "run_entries: a record's phys offset does not fit 64 bits");
    return NULL;
}

/* run_entries(phys, sizes, i0, i1, sts, ckpt) -> (entries, p0)
 *     The inner loop of lightqueue/take.py `take_runs` (its Python reference there, `run_entries_py`):
 *     the records sizes[i0:i1] of one run, back to back from `phys`; for each record whose phys is
 *     >= ckpt (else already indexed), ENTRY.pack(phys, size, sts) (>QIQ), joined; p0 the phys of
 *     the first one taken, -1 when none (entries then b"").
 *     Why: py-spy --gil of `lmqtt bench ha --cases append-replicated` put that loop (a pack and an
 *     append per record, then a join) at ~37 of 317 GIL samples on a replica and ~45 of 536 on the
 *     primary. Every size must be an int in [0, 2**32) and every phys packed must fit 64 bits
 *     (OverflowError; the reference raises struct.error for one that is packed). */
static PyObject *run_entries(PyObject *self, PyObject *args) {
    PyObject *phys_o, *sizes, *sts_o, *ckpt_o;
    Py_ssize_t i0, i1;
    if (!PyArg_ParseTuple(args, "O!O!nnO!O!", &PyLong_Type, &phys_o, &PyList_Type, &sizes, &i0, &i1,
                          &PyLong_Type, &sts_o, &PyLong_Type, &ckpt_o))
        return NULL;
    if (!configured) {
        PyErr_SetString(PyExc_RuntimeError, "lmqtt.lightqueue._take.configure() was not called or failed");
        return NULL;
    }
    Py_ssize_t ns = PyList_GET_SIZE(sizes);
    if (i0 < 0) i0 = 0;
    if (i1 > ns) i1 = ns;
    u128 ckpt;
    if (ckpt_bound(ckpt_o, &ckpt) < 0) return NULL;
    if (i1 <= i0) return no_entries();
    unsigned long long phys0 = PyLong_AsUnsignedLongLong(phys_o);
    if (phys0 == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    /* the records below ckpt are skipped (already indexed); the reference packs the first one at
     * or past it, and refuses one past 2**64 - 1: so does this */
    Py_ssize_t i = i0;
    uint32_t s;
    u128 p = phys0;
    while (i < i1 && p < ckpt) {
        if (size_at(sizes, i, &s) < 0) return NULL;
        p += s;
        i++;
    }
    if (i == i1) return no_entries();
    if (p >> 64) return phys_overflow();
    unsigned long long phys = (unsigned long long)p;
    unsigned long long sts = PyLong_AsUnsignedLongLong(sts_o);
    if (sts == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    unsigned long long p0 = phys;
    PyObject *out = PyBytes_FromStringAndSize(NULL, (i1 - i) * ENTRY_SIZE);
    if (out == NULL) return NULL;
    unsigned char *e = (unsigned char *)PyBytes_AS_STRING(out);
    for (; i < i1; i++, e += ENTRY_SIZE) {
        if (size_at(sizes, i, &s) < 0) { Py_DECREF(out); return NULL; }
        put_be64(e, (uint64_t)phys);
        put_be32(e + 8, s);
        put_be64(e + 12, (uint64_t)sts);
        unsigned long long next = phys + s;
        if (next < phys && i + 1 < i1) { Py_DECREF(out); return phys_overflow(); }
        phys = next;
    }
    return Py_BuildValue("(NK)", out, p0);
}

static int get_index(PyObject *d, const char *key, Py_ssize_t *out) {
    PyObject *v = PyDict_GetItemString(d, key);
    if (v == NULL) {
        PyErr_Format(PyExc_ValueError, "configure: layout has no %s", key);
        return -1;
    }
    *out = PyLong_AsSsize_t(v);
    if (*out == -1 && PyErr_Occurred()) return -1;
    if (*out < 0 || *out > 64) {
        PyErr_Format(PyExc_ValueError, "configure: %s = %zd is out of range", key, *out);
        return -1;
    }
    return 0;
}

/* configure(layout): {"entry_format": ">QIQ", "dr_phys", "dr_size", "dr_store_ts",
 * "dr_dispatch_queues", "dr_len", "res_tail", "res_filter_tails", "res_first_name", "res_mark",
 * "res_other_names", "res_len"} (lightqueue/take.py TAKE_LAYOUT). */
static PyObject *configure(PyObject *self, PyObject *args) {
    PyObject *d;
    if (!PyArg_ParseTuple(args, "O!", &PyDict_Type, &d)) return NULL;
    configured = 0;
    PyObject *ef = PyDict_GetItemString(d, "entry_format");
    if (ef == NULL || !PyUnicode_Check(ef) || PyUnicode_CompareWithASCIIString(ef, ">QIQ") != 0) {
        PyErr_SetString(PyExc_ValueError, "configure: the light-queue entry format must be >QIQ "
                        "(phys_offset, size, store_ts), the layout this loop packs");
        return NULL;
    }
    if (get_index(d, "dr_phys", &dr_phys) < 0 || get_index(d, "dr_size", &dr_size) < 0 ||
        get_index(d, "dr_store_ts", &dr_store_ts) < 0 || get_index(d, "dr_dispatch_queues", &dr_qs) < 0 ||
        get_index(d, "dr_len", &dr_len) < 0 || get_index(d, "res_tail", &res_tail) < 0 ||
        get_index(d, "res_filter_tails", &res_filters) < 0 || get_index(d, "res_first_name", &res_first) < 0 ||
        get_index(d, "res_mark", &res_mark) < 0 || get_index(d, "res_other_names", &res_others) < 0 ||
        get_index(d, "res_len", &res_len) < 0)
        return NULL;
    if (dr_phys >= dr_len || dr_size >= dr_len || dr_store_ts >= dr_len || dr_qs >= dr_len ||
        res_tail >= res_len || res_filters >= res_len || res_first >= res_len || res_mark >= res_len ||
        res_others >= res_len) {
        PyErr_SetString(PyExc_ValueError, "configure: a position is past the tuple/list length given");
        return NULL;
    }
    configured = 1;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS, "configure(layout): positions and entry format (lightqueue/take.py)"},
    {"take_requests", take_requests, METH_VARARGS,
     "take_requests(index, batch, ckpt, touched, touched_f, mark): lightqueue.take.take_requests in C"},
    {"run_entries", run_entries, METH_VARARGS,
     "run_entries(phys, sizes, i0, i1, sts, ckpt) -> (entries, p0): the entries of one run of take_runs"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "lmqtt.lightqueue._take",
                                    "C accelerator for lightqueue.take.take_requests (optional)", -1,
                                    methods};

PyMODINIT_FUNC PyInit__take(void) {
    if ((s_resolved = PyUnicode_InternFromString("resolved")) == NULL) return NULL;
    if ((s_resolve = PyUnicode_InternFromString("resolve")) == NULL) return NULL;
    return PyModule_Create(&moddef);
}
