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
 * configure(layout) must succeed first (store/fastpath.py calls it at import, with
 * `fastpath.C_LAYOUT`): the ConsumeQueue entry format, field names and size (store/consume_queue.py
 * ENTRY, ENTRY_FIELDS), and the record header format and field names (store/record.py HEADER,
 * HEADER_FIELDS). They are checked against the fields these loops read (offset, width and name;
 * the tables below and store/_layout.h) and a mismatch raises ValueError naming the field, so a
 * layout change on the Python side cannot make these loops read the wrong bytes; until a
 * configure() succeeds both functions raise RuntimeError. The magic number and CRC start are handed in by
 * the caller on every check_records call (store/record.py), not compiled in.
 *
 *   cq_runs(piece, first_qoff, visible, max_bytes, count, total)
 *       piece: ConsumeQueue entries (phys u64, size u32, tags u64, little-endian; ENTRY_SIZE each).
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
#define ENTRY_SIZE 20   /* a ConsumeQueue entry, <QIQ (store/consume_queue.py ENTRY), checked by configure() */
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
    if (!PyArg_ParseTuple(args, "y*LKKLK", &piece, &first_qoff, &visible, &max_bytes, &count, &total))
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
    int stopped = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        const unsigned char *e = p + i * ENTRY_SIZE;
        unsigned long long phys = le64(e + E_PHYS);
        uint32_t size = le32(e + E_SIZE);
        if (size == 0) continue;                            /* not written */
        if (phys >= visible || (max_bytes && count && total + size > max_bytes)) {
            stopped = 1;
            break;
        }
        if (!in_run || phys != run_end) {
            if (flush_run(runs, run_phys, run_end, sizes, in_run) < 0) goto fail;
            in_run = 0;
            run_phys = phys;
        }
        sizes[in_run++] = size;
        run_end = phys + size;
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


/* ------------------------------------------------------------------ configuration */
#define READS "these loops read"

/* configure(layout): {"cq_entry_format": "<QIQ", "cq_entry_fields": ("phys_offset", "size",
 * "tags_code"), "cq_entry_size": 20, "record_header_format": "<IIIIIQQQQQIIHHH",
 * "record_header_fields": ("total_size", "magic", "crc", ...)} (store/fastpath.py C_LAYOUT, from
 * store/consume_queue.py and store/record.py). A refused layout leaves the module unconfigured. */
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
        check_format("record header", hf, '<', record_head_fields, N_PREFIX_FIELDS, 0, &head_size, READS) < 0 ||
        check_names("record header", PyDict_GetItemString(layout, "record_header_fields"), record_head_fields,
                    N_PREFIX_FIELDS, 0, READS) < 0)
        return NULL;
    configured = 1;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS,
     "configure(layout): ConsumeQueue entry and record header formats, checked (see module doc)"},
    {"cq_runs", cq_runs, METH_VARARGS, "ConsumeQueue entries -> runs of adjacent records (see module doc)"},
    {"check_records", check_records, METH_VARARGS, "sizes, magic and CRC of records back to back (see module doc)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fastpath",
    "C loops of store/fastpath.py's raw read (Python references beside them there)", -1, methods};

PyMODINIT_FUNC PyInit__fastpath(void) { return PyModule_Create(&module); }
