/* lmqtt.store.spark._columns: a MESSAGES body (docs/protocol.md) -> Arrow column buffers.
 *
 * The C twin of `columns_py` in store/spark/columns.py (the reference; tests compare the two
 * byte for byte). Spark's reader spends most of its time turning records into columns; this loop
 * walks the body once and writes every column's buffers directly, little-endian as Arrow wants:
 *
 *   columns(body, pos, count, ident) -> (qo, po, born_us, store_us, topic_offsets, topic_data,
 *                                        props_offsets, props_data, body_offsets, body_data,
 *                                        msgid_offsets, msgid_data)
 *   columns_raw(...)                   the same from a raw MESSAGES body (frame flag F_RAW): the
 *                                      records are CommitLog records, little-endian head
 *                                      (docs/store.md), dispatch queues skipped
 *
 * `pos` is where the first record starts (after the JSON header and the count), `count` the
 * number of records, `ident` the store's identity prefixing every message id
 * (ident + 16 upper-case hex digits of the physical offset). The fixed part of each record is
 *   u64 queue offset, u64 phys offset, u64 born ms, u64 store ms, u32 queue id,
 *   u16 topic length, u16 keys length, u16 props length, u32 body length   (big-endian)
 * Offsets buffers are int32 (count + 1 entries): a batch above 2 GiB of one column is refused.
 *
 * configure(layout) must succeed first (store/spark/columns.py calls it at import with
 * columns.C_LAYOUT): the struct format, field names and size of the MESSAGES record head
 * (store/protocol.py REC_HEAD, REC_HEAD_FIELDS) and of the CommitLog record head (store/record.py
 * HEADER, HEADER_FIELDS, HEADER_SIZE), checked against the fields this walk reads (offset, width
 * and name; rec_fields below, record_head_fields in store/_layout.h). A mismatch raises ValueError
 * naming the field, so a layout change on the Python side cannot make this walk fill wrong
 * columns; until a configure() succeeds, columns() and columns_raw() raise RuntimeError.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "../_layout.h"

/* Where this walk reads each field, in the order of the Python struct; checked by configure(). */
/* the MESSAGES record head (store/protocol.py REC_HEAD, big-endian) */
enum { M_QOFF = 0, M_PHYS = 8, M_BORN = 16, M_STORE = 24, M_QID = 32, M_TOPIC_LEN = 36, M_KEYS_LEN = 38,
       M_PROPS_LEN = 40, M_BODY_LEN = 42, REC_HEAD = 46 };
static const field_t rec_fields[] = {
    {"queue_offset", M_QOFF, 8}, {"phys_offset", M_PHYS, 8}, {"born_ts", M_BORN, 8}, {"store_ts", M_STORE, 8},
    {"queue_id", M_QID, 4}, {"topic_len", M_TOPIC_LEN, 2}, {"keys_len", M_KEYS_LEN, 2},
    {"props_len", M_PROPS_LEN, 2}, {"body_len", M_BODY_LEN, 4}};
_Static_assert(M_BODY_LEN + 4 == REC_HEAD, "rec_fields end at REC_HEAD");
/* a CommitLog record head (raw layout, frame flag F_RAW): store/_layout.h's F_* offsets and
 * record_head_fields (store/record.py HEADER, little-endian), F_END bytes */
#define RAW_HEAD F_END

static int configured = 0;     /* set by configure(); the walks refuse to run before */

static inline uint64_t be64(const unsigned char *p) {
    return ((uint64_t)p[0] << 56) | ((uint64_t)p[1] << 48) | ((uint64_t)p[2] << 40) | ((uint64_t)p[3] << 32) |
           ((uint64_t)p[4] << 24) | ((uint64_t)p[5] << 16) | ((uint64_t)p[6] << 8) | (uint64_t)p[7];
}
static inline uint32_t be32(const unsigned char *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | (uint32_t)p[3];
}
static inline uint16_t be16(const unsigned char *p) { return (uint16_t)((p[0] << 8) | p[1]); }

static inline void put_le64(char *dst, uint64_t v) {
    for (int i = 0; i < 8; i++) dst[i] = (char)((v >> (8 * i)) & 0xFF);
}
static inline void put_le32(char *dst, uint32_t v) {
    for (int i = 0; i < 4; i++) dst[i] = (char)((v >> (8 * i)) & 0xFF);
}

static inline uint64_t le64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}
static inline uint32_t le32(const unsigned char *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static inline uint16_t le16(const unsigned char *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

/* One record's fields, from either layout. Returns 0, or -1 with a ValueError set. */
typedef struct {
    uint64_t qo, phys, born, st;
    Py_ssize_t head, tl, kl, skip, pl, bl;   /* skip: bytes between keys and props (dispatch queues) */
} rec_t;

static int parse(int raw, const unsigned char *h, Py_ssize_t avail, rec_t *r) {
    if (!raw) {
        if (avail < REC_HEAD) goto short_head;
        r->qo = be64(h + M_QOFF); r->phys = be64(h + M_PHYS); r->born = be64(h + M_BORN); r->st = be64(h + M_STORE);
        r->tl = be16(h + M_TOPIC_LEN); r->kl = be16(h + M_KEYS_LEN); r->pl = be16(h + M_PROPS_LEN);
        r->bl = be32(h + M_BODY_LEN);
        r->skip = 0; r->head = REC_HEAD;
    } else {
        /* a CommitLog record (docs/store.md): little-endian head */
        if (avail < RAW_HEAD) goto short_head;
        Py_ssize_t total = le32(h + F_TOTAL);
        r->qo = le64(h + F_QOFF); r->phys = le64(h + F_PHYS); r->born = le64(h + F_BORN); r->st = le64(h + F_STORE);
        r->bl = le32(h + F_BODY_LEN); r->pl = le32(h + F_PROPS_LEN); r->tl = le16(h + F_TOPIC_LEN);
        r->kl = le16(h + F_KEYS_LEN); r->skip = le16(h + F_DQ_LEN); r->head = RAW_HEAD;
        if (total != RAW_HEAD + r->tl + r->kl + r->skip + r->pl + r->bl) {
            PyErr_SetString(PyExc_ValueError, "MESSAGES body malformed: record size does not match its lengths");
            return -1;
        }
    }
    if (avail - r->head < r->tl + r->kl + r->skip + r->pl + r->bl) {
        PyErr_SetString(PyExc_ValueError, "MESSAGES body malformed: record truncated");
        return -1;
    }
    return 0;
short_head:
    PyErr_SetString(PyExc_ValueError, "MESSAGES body malformed: record header truncated");
    return -1;
}

static PyObject *walk(PyObject *args, int raw) {
    Py_buffer buf;
    Py_ssize_t pos, count;
    const char *ident;
    Py_ssize_t ident_len;
    if (!PyArg_ParseTuple(args, "y*nny#", &buf, &pos, &count, &ident, &ident_len))
        return NULL;
    if (!configured) {
        PyBuffer_Release(&buf);
        PyErr_SetString(PyExc_RuntimeError, "lmqtt.store.spark._columns.configure() was not called or failed "
                        "(store/spark/columns.py configures it at import)");
        return NULL;
    }
    const unsigned char *b = (const unsigned char *)buf.buf;
    Py_ssize_t n = buf.len;
    PyObject *result = NULL;
    PyObject *cols[12] = {NULL};
    if (count < 0 || pos < 0 || pos > n) {
        PyErr_SetString(PyExc_ValueError, "MESSAGES body malformed: bad start or count");
        goto done;
    }
    /* pass 1: validate and size the variable-length columns */
    Py_ssize_t p = pos, topic_total = 0, props_total = 0, body_total = 0;
    rec_t r;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (parse(raw, b + p, n - p, &r) < 0)
            goto done;
        p += r.head + r.tl + r.kl + r.skip + r.pl + r.bl;
        topic_total += r.tl;
        props_total += r.pl;
        body_total += r.bl;
    }
    Py_ssize_t id_len = ident_len + 16;
    if (topic_total > INT32_MAX || props_total > INT32_MAX || body_total > INT32_MAX ||
        id_len * count > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "MESSAGES batch too large for 32-bit Arrow offsets");
        goto done;
    }
    Py_ssize_t sizes[12] = {8 * count, 8 * count, 8 * count, 8 * count,
                            4 * (count + 1), topic_total, 4 * (count + 1), props_total,
                            4 * (count + 1), body_total, 4 * (count + 1), id_len * count};
    char *out[12];
    for (int c = 0; c < 12; c++) {
        cols[c] = PyBytes_FromStringAndSize(NULL, sizes[c]);
        if (cols[c] == NULL)
            goto done;
        out[c] = PyBytes_AS_STRING(cols[c]);
    }
    /* pass 2: fill */
    static const char HEX[] = "0123456789ABCDEF";
    uint32_t to = 0, po_ = 0, bo = 0, mo = 0;
    put_le32(out[4], 0); put_le32(out[6], 0); put_le32(out[8], 0); put_le32(out[10], 0);
    p = pos;
    for (Py_ssize_t i = 0; i < count; i++) {
        parse(raw, b + p, n - p, &r);          /* validated in pass 1 */
        uint64_t phys = r.phys;
        Py_ssize_t tl = r.tl, pl = r.pl, bl = r.bl;
        put_le64(out[0] + 8 * i, r.qo);
        put_le64(out[1] + 8 * i, phys);
        put_le64(out[2] + 8 * i, r.born * 1000);
        put_le64(out[3] + 8 * i, r.st * 1000);
        p += r.head;
        memcpy(out[5] + to, b + p, tl);
        to += (uint32_t)tl;
        put_le32(out[4] + 4 * (i + 1), to);
        p += tl + r.kl + r.skip;
        memcpy(out[7] + po_, b + p, pl);
        po_ += (uint32_t)pl;
        put_le32(out[6] + 4 * (i + 1), po_);
        p += pl;
        memcpy(out[9] + bo, b + p, bl);
        bo += (uint32_t)bl;
        put_le32(out[8] + 4 * (i + 1), bo);
        p += bl;
        char *m = out[11] + mo;
        memcpy(m, ident, ident_len);
        for (int d = 0; d < 16; d++)
            m[ident_len + d] = HEX[(phys >> (4 * (15 - d))) & 0xF];
        mo += (uint32_t)id_len;
        put_le32(out[10] + 4 * (i + 1), mo);
    }
    result = PyTuple_New(12);
    if (result == NULL)
        goto done;
    for (int c = 0; c < 12; c++) {
        PyTuple_SET_ITEM(result, c, cols[c]);
        cols[c] = NULL;
    }
done:
    for (int c = 0; c < 12; c++)
        Py_XDECREF(cols[c]);
    PyBuffer_Release(&buf);
    return result;
}

static PyObject *columns(PyObject *self, PyObject *args) { return walk(args, 0); }
static PyObject *columns_raw(PyObject *self, PyObject *args) { return walk(args, 1); }


/* ------------------------------------------------------------------ configuration */
#define READS "this walk reads"

/* configure(layout): {"rec_head_format": protocol.REC_HEAD.format, "rec_head_fields":
 * protocol.REC_HEAD_FIELDS, "rec_head_size": REC_HEAD.size,
 * "raw_head_format": record.HEADER.format, "raw_head_fields": record.HEADER_FIELDS,
 * "raw_head_size": record.HEADER_SIZE} (columns.C_LAYOUT).
 * A refused layout leaves both walks unusable. */
static PyObject *configure(PyObject *self, PyObject *args) {
    PyObject *layout;
    if (!PyArg_ParseTuple(args, "O!", &PyDict_Type, &layout)) return NULL;
    configured = 0;
    if (check_struct(layout, "MESSAGES record head", "rec_head_format", "rec_head_size", '>', rec_fields,
                     N_FIELDS(rec_fields), REC_HEAD, READS) < 0 ||
        check_names("MESSAGES record head", PyDict_GetItemString(layout, "rec_head_fields"), rec_fields,
                    N_FIELDS(rec_fields), 1, READS) < 0 ||
        check_struct(layout, "CommitLog record head", "raw_head_format", "raw_head_size", '<',
                     record_head_fields, N_FIELDS(record_head_fields), RAW_HEAD, READS) < 0 ||
        check_names("CommitLog record head", PyDict_GetItemString(layout, "raw_head_fields"), record_head_fields,
                    N_FIELDS(record_head_fields), 1, READS) < 0)
        return NULL;
    configured = 1;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS,
     "configure(layout): the MESSAGES and CommitLog record head formats, checked (see columns.py)"},
    {"columns", columns, METH_VARARGS, "MESSAGES records -> Arrow column buffers (see columns.py)"},
    {"columns_raw", columns_raw, METH_VARARGS, "raw MESSAGES (CommitLog records) -> Arrow column buffers"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_columns", NULL, -1, methods};

PyMODINIT_FUNC PyInit__columns(void) { return PyModule_Create(&module); }
