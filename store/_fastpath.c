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
 * `fastpath.C_LAYOUT`): the ConsumeQueue entry format (store/consume_queue.py ENTRY) and size,
 * and the record header format and field names (store/record.py HEADER, HEADER_FIELDS). They are
 * checked against the offsets
 * these loops read (enums below) and a mismatch raises ValueError naming the field, so a layout
 * change on the Python side cannot make these loops read the wrong bytes; until a configure()
 * succeeds both functions raise RuntimeError. The magic number and CRC start are handed in by
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

/* What these loops read, checked by configure() against the Python definitions. */
#define ENTRY_SIZE 20   /* a ConsumeQueue entry, <QIQ (store/consume_queue.py ENTRY), checked by configure() */
enum { E_PHYS = 0, E_SIZE = 8, E_TAGS = 12 };                   /* its fields */
enum { R_TOTAL = 0, R_MAGIC = 4, R_CRC = 8, R_PREFIX_END = 12 }; /* a record's first fields (store/record.py HEADER) */

typedef struct { const char *name; int offset; int width; } field_t;
static const field_t entry_fields[] = {{"phys_offset", E_PHYS, 8}, {"size", E_SIZE, 4}, {"tags_code", E_TAGS, 8}};
static const field_t prefix_fields[] = {{"total_size", R_TOTAL, 4}, {"magic", R_MAGIC, 4}, {"crc", R_CRC, 4}};
#define N_FIELDS(a) ((int)(sizeof a / sizeof a[0]))
_Static_assert(E_TAGS + 8 == ENTRY_SIZE, "entry_fields end at ENTRY_SIZE");
_Static_assert(R_CRC + 4 == R_PREFIX_END, "prefix_fields end at R_PREFIX_END");

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
        if (size < R_PREFIX_END || size < crc_start || a + (Py_ssize_t)size > chunk.len) { ok = 0; break; }
        const unsigned char *r = c + a;
        if (le32(r + R_TOTAL) != size || le32(r + R_MAGIC) != magic ||
            (uint32_t)crc32(0L, r + crc_start, (uInt)(size - crc_start)) != le32(r + R_CRC)) {
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

/* Check that the field names `names` (a tuple of str from Python, `what` names the struct) start
 * with the names of `want` (are exactly them when `exact`); ValueError naming the first that
 * differs. Catches a reorder of two fields of the same width, which offsets alone do not. */
static int check_names(const char *what, PyObject *names, const field_t *want, int nwant, int exact) {
    if (names == NULL || !PyTuple_Check(names)) {
        PyErr_Format(PyExc_ValueError, "configure: layout has no tuple of %s field names", what);
        return -1;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(names);
    if (exact ? n != nwant : n < nwant) {
        PyErr_Format(PyExc_ValueError, "configure: %s has %zd field names, %s %s%d", what, n, READS,
                     exact ? "" : "at least ", nwant);
        return -1;
    }
    for (int i = 0; i < nwant; i++) {
        PyObject *f = PyTuple_GET_ITEM(names, i);
        if (!PyUnicode_Check(f) || PyUnicode_CompareWithASCIIString(f, want[i].name) != 0) {
            PyErr_Format(PyExc_ValueError, "configure: %s field %d is %R, %s %s there", what, i, f, READS,
                         want[i].name);
            return -1;
        }
    }
    return 0;
}
/* The fields of a little-endian struct format made of Q, I and H codes ("<QIQ"): fills offs[] and
 * widths[] (at most max entries) and returns the field count, with *size the total; -1 if the
 * format is not little-endian or has another code. */
static int format_fields(const char *fmt, int *offs, int *widths, int max, long long *size) {
    int n = 0;
    long long at = 0;
    if (*fmt != '<') return -1;
    for (fmt++; *fmt; fmt++) {
        int w = *fmt == 'Q' ? 8 : *fmt == 'I' ? 4 : *fmt == 'H' ? 2 : 0;
        if (w == 0) return -1;
        if (n < max) {
            offs[n] = (int)at;
            widths[n] = w;
        }
        n++;
        at += w;
    }
    *size = at;
    return n;
}

/* Check that `fmt` (a struct format from Python, `what` names it) starts with the fields `want`
 * (all of it when `exact`); ValueError naming the first field that differs. */
static int check_format(const char *what, const char *fmt, const field_t *want, int nwant, int exact,
                        long long *size) {
    int offs[64], widths[64];
    int n = format_fields(fmt, offs, widths, 64, size);
    if (n < 0) {
        PyErr_Format(PyExc_ValueError, "configure: %s format %s is not little-endian Q/I/H fields, "
                     "the layout these loops read", what, fmt);
        return -1;
    }
    if (exact ? n != nwant : n < nwant) {
        PyErr_Format(PyExc_ValueError, "configure: %s format %s has %d fields, these loops read %s%d",
                     what, fmt, n, exact ? "" : "at least ", nwant);
        return -1;
    }
    for (int i = 0; i < nwant; i++)
        if (offs[i] != want[i].offset || widths[i] != want[i].width) {
            PyErr_Format(PyExc_ValueError, "configure: %s field %d (%s) is %d bytes at offset %d in %s, "
                         "these loops read %d bytes at offset %d", what, i, want[i].name, widths[i], offs[i],
                         fmt, want[i].width, want[i].offset);
            return -1;
        }
    return 0;
}

static const char *layout_str(PyObject *layout, const char *key) {
    PyObject *v = PyDict_GetItemString(layout, key);
    if (v == NULL || !PyUnicode_Check(v)) {
        PyErr_Format(PyExc_ValueError, "configure: layout has no str %s", key);
        return NULL;
    }
    return PyUnicode_AsUTF8(v);
}

static int layout_int(PyObject *layout, const char *key, long long *out) {
    PyObject *v = PyDict_GetItemString(layout, key);
    if (v == NULL || !PyLong_Check(v)) {
        PyErr_Format(PyExc_ValueError, "configure: layout has no int %s", key);
        return -1;
    }
    *out = PyLong_AsLongLong(v);
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

/* configure(layout): {"cq_entry_format": "<QIQ", "cq_entry_size": 20, "record_header_format":
 * "<IIIIIQQQQQIIHHH", "record_header_fields": ("total_size", "magic", "crc", ...)}
 * (store/fastpath.py C_LAYOUT, from store/consume_queue.py and store/record.py). A refused layout
 * leaves the module unconfigured. */
static PyObject *configure(PyObject *self, PyObject *args) {
    PyObject *layout;
    long long entry_size, fmt_size, head_size;
    if (!PyArg_ParseTuple(args, "O!", &PyDict_Type, &layout)) return NULL;
    configured = 0;
    const char *ef = layout_str(layout, "cq_entry_format");
    if (ef == NULL || layout_int(layout, "cq_entry_size", &entry_size) < 0) return NULL;
    if (check_format("ConsumeQueue entry", ef, entry_fields, N_FIELDS(entry_fields), 1, &fmt_size) < 0)
        return NULL;
    if (entry_size != fmt_size || entry_size != ENTRY_SIZE) {
        PyErr_Format(PyExc_ValueError, "configure: ConsumeQueue cq_entry_size %lld (format %s: %lld bytes), "
                     "these loops step %d bytes per entry", entry_size, ef, fmt_size, ENTRY_SIZE);
        return NULL;
    }
    const char *hf = layout_str(layout, "record_header_format");
    if (hf == NULL) return NULL;
    if (check_format("record header", hf, prefix_fields, N_FIELDS(prefix_fields), 0, &head_size) < 0 ||
        check_names("record header", PyDict_GetItemString(layout, "record_header_fields"), prefix_fields,
                    N_FIELDS(prefix_fields), 0) < 0)
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
