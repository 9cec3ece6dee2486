/* lmqtt.lightqueue._retained: the per-entry loop of MetadataStore's retained scan in C.
 *
 * Why: a `#` subscribe over 1,000 retained topics spent ~350 us of the broker's ~1,200 us turning
 * RocksDB's (key, value) pairs into (topic, payload, props): per entry a key slice and UTF-8
 * decode, the payload length read, two value slices and a tuple, in Python.
 *
 * The Python reference is `retained_rows_py` in lightqueue/retained_messages.py; tests compare the two on
 * arbitrary keys and values (tests/lightqueue/test_retained_accel.py). The key layout (kind byte,
 * then the topic) and the value layout (u32 big-endian payload length, payload, props) are those
 * of metadata_keys.py / retained_messages.py; the caller hands in the lengths.
 *
 *   retained_rows(items, n, plen, klen, below) -> (rows, exhausted)
 *       Takes up to `n` (key, value) pairs from the iterator `items`; keeps those whose key is
 *       `klen` bytes long or starts with `below` (None: keeps all); each kept pair becomes
 *       (key[plen:] decoded as UTF-8, payload, props). exhausted: True when `items` ended.
 *       A value shorter than its length prefix says raises ValueError.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

static PyObject *retained_rows(PyObject *self, PyObject *args) {
    PyObject *items, *below;
    Py_ssize_t n, plen, klen;
    if (!PyArg_ParseTuple(args, "OnnnO", &items, &n, &plen, &klen, &below)) return NULL;
    const char *bp = NULL;
    Py_ssize_t blen = 0;
    if (below != Py_None) {
        if (!PyBytes_Check(below)) {
            PyErr_SetString(PyExc_TypeError, "below must be bytes or None");
            return NULL;
        }
        bp = PyBytes_AS_STRING(below);
        blen = PyBytes_GET_SIZE(below);
    }
    PyObject *rows = PyList_New(0);
    if (!rows) return NULL;
    int exhausted = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pair = PyIter_Next(items);
        if (!pair) {
            if (PyErr_Occurred()) goto fail;
            exhausted = 1;
            break;
        }
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2 || !PyBytes_Check(PyTuple_GET_ITEM(pair, 0))
                || !PyBytes_Check(PyTuple_GET_ITEM(pair, 1))) {
            Py_DECREF(pair);
            PyErr_SetString(PyExc_TypeError, "items must yield (bytes, bytes) pairs");
            goto fail;
        }
        PyObject *k = PyTuple_GET_ITEM(pair, 0), *v = PyTuple_GET_ITEM(pair, 1);
        const char *kp = PyBytes_AS_STRING(k);
        Py_ssize_t kl = PyBytes_GET_SIZE(k);
        if (bp && kl != klen && !(kl >= blen && memcmp(kp, bp, (size_t)blen) == 0)) {
            Py_DECREF(pair);
            continue;
        }
        const unsigned char *vp = (const unsigned char *)PyBytes_AS_STRING(v);
        Py_ssize_t vl = PyBytes_GET_SIZE(v);
        if (vl < 4 || kl < plen) {
            Py_DECREF(pair);
            PyErr_SetString(PyExc_ValueError, "retained value shorter than its length prefix");
            goto fail;
        }
        Py_ssize_t pl = ((Py_ssize_t)vp[0] << 24) | ((Py_ssize_t)vp[1] << 16) | ((Py_ssize_t)vp[2] << 8) | vp[3];
        if (4 + pl > vl) {
            Py_DECREF(pair);
            PyErr_SetString(PyExc_ValueError, "retained value shorter than its length prefix");
            goto fail;
        }
        PyObject *row = PyTuple_New(3);
        PyObject *topic = PyUnicode_DecodeUTF8(kp + plen, kl - plen, "strict");
        PyObject *payload = PyBytes_FromStringAndSize((const char *)vp + 4, pl);
        PyObject *props = PyBytes_FromStringAndSize((const char *)vp + 4 + pl, vl - 4 - pl);
        Py_DECREF(pair);
        if (!row || !topic || !payload || !props) {
            Py_XDECREF(row); Py_XDECREF(topic); Py_XDECREF(payload); Py_XDECREF(props);
            goto fail;
        }
        PyTuple_SET_ITEM(row, 0, topic);
        PyTuple_SET_ITEM(row, 1, payload);
        PyTuple_SET_ITEM(row, 2, props);
        int rc = PyList_Append(rows, row);
        Py_DECREF(row);
        if (rc < 0) goto fail;
    }
    return Py_BuildValue("(NO)", rows, exhausted ? Py_True : Py_False);
fail:
    Py_DECREF(rows);
    return NULL;
}

static PyMethodDef methods[] = {
    {"retained_rows", retained_rows, METH_VARARGS,
     "retained_rows(items, n, plen, klen, below) -> (rows, exhausted): see retained_messages.retained_rows_py"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_retained", NULL, -1, methods};

PyMODINIT_FUNC PyInit__retained(void) { return PyModule_Create(&module); }
