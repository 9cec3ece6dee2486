/* lmqtt.store.client._records: the SDK's decode of a raw MESSAGES reply in C (optional accelerator).
 *
 * Why: a pull of 1,024 records of 100 bytes spent ~2 us of client CPU per record in the Python loop
 * (`consumer._records_raw`: a 15-field struct unpack, four slices, a named tuple and an f-string
 * msg id per record), which held `lmqtt bench sdk` pull at ~250k msg/s with the server at 1.6 us.
 * This does exactly what `_records_raw` does, record for record (tests/store/test_sdk_records.py
 * compares them on generated and real replies); the Python loop stays the reference and the
 * fallback when this does not build or LMQTT_PURE_PYTHON=1 is set (store/accel.py).
 *
 * decode(body, pos, count, ident, Record) -> list of Record
 *
 * `body[pos:]` holds `count` CommitLog records (docs/store.md): a 74-byte little-endian head
 * (total u32, magic u32, crc u32, queue_id u32, flags u32, queue_offset u64, phys_offset u64,
 * born_ts u64, store_ts u64, tags u64, body_len u32, props_len u32, topic_len u16, keys_len u16,
 * dq_len u16), then topic, keys (NUL-joined), dispatch queues, props, body. Each Record is
 * (topic, body, keys, props, queue_id, queue_offset, phys_offset, born_ts, store_ts, msg_id) with
 * msg_id = ident + 16 upper-case hex digits of phys_offset. Topic and props objects are shared with
 * the previous record when their bytes are equal (one object per run, like the Python loop's
 * per-reply caches give equal values). Raises ValueError for a record that does not fit.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define HEAD 74

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
    PyObject *ident, *rtype;
    if (!PyArg_ParseTuple(args, "y*nnUO", &buf, &pos, &count, &ident, &rtype))
        return NULL;
    if (!PyType_Check(rtype) || !PyType_IsSubtype((PyTypeObject *)rtype, &PyTuple_Type)) {
        PyBuffer_Release(&buf);
        PyErr_SetString(PyExc_TypeError, "Record must be a tuple subclass");
        return NULL;
    }
    PyTypeObject *rt = (PyTypeObject *)rtype;
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
        if (pos + HEAD > n) {
            PyErr_Format(PyExc_ValueError, "record %zd: head truncated at byte %zd", i, pos);
            goto fail;
        }
        const unsigned char *h = b + pos;
        uint32_t total = le32(h);
        uint32_t bl = le32(h + 60), pl = le32(h + 64);
        uint16_t tl = le16(h + 68), kl = le16(h + 70), dl = le16(h + 72);
        if ((uint64_t)pos + total > (uint64_t)n || (uint64_t)total != (uint64_t)HEAD + tl + kl + dl + pl + bl) {
            PyErr_Format(PyExc_ValueError, "record at %zd of %u bytes does not fit its fields", pos, total);
            goto fail;
        }
        const unsigned char *p = h + HEAD;
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
        uint64_t phys = le64(h + 28);
        snprintf(idbuf + idlen, sizeof idbuf - idlen, "%016llX", (unsigned long long)phys);
        PyObject *rec = rt->tp_alloc(rt, 10);
        if (rec == NULL) {
            Py_DECREF(keys);
            goto fail;
        }
        PyObject *f[10];
        f[0] = Py_NewRef(topic);
        f[1] = PyBytes_FromStringAndSize((const char *)p, bl);
        f[2] = keys;
        f[3] = Py_NewRef(props);
        f[4] = PyLong_FromUnsignedLong(le32(h + 12));
        f[5] = PyLong_FromUnsignedLongLong(le64(h + 20));
        f[6] = PyLong_FromUnsignedLongLong(phys);
        f[7] = PyLong_FromUnsignedLongLong(le64(h + 36));
        f[8] = PyLong_FromUnsignedLongLong(le64(h + 44));
        f[9] = PyUnicode_FromStringAndSize(idbuf, idlen + 16);
        int bad = 0;
        for (int k = 0; k < 10; k++) {
            if (f[k] == NULL)
                bad = 1;
            PyTuple_SET_ITEM(rec, k, f[k]);   /* NULL items are fine for the dealloc below */
        }
        if (bad || PyList_Append(out, rec) < 0) {
            Py_DECREF(rec);
            goto fail;
        }
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

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS, "decode(body, pos, count, ident, Record) -> [Record] (see module doc)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "lmqtt.store.client._records",
                                    "Raw MESSAGES -> SDK Records (C twin of consumer._records_raw).", -1, methods};

PyMODINIT_FUNC PyInit__records(void) {
    empty_tuple = PyTuple_New(0);
    nul_str = PyUnicode_FromStringAndSize("\0", 1);
    if (empty_tuple == NULL || nul_str == NULL)
        return NULL;
    return PyModule_Create(&moddef);
}
