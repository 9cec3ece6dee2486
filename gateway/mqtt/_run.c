/* lmqtt.gateway.mqtt._run: `encode_publish_run` of gateway/mqtt/encoder.py in C.
 *
 * Why: a run of PUBLISHes without properties is what lmqtt sends when it hands over stored
 * messages: the retained messages of a SUBSCRIBE, an offline session's backlog on reconnect, a
 * history on `$replay/`. For 1,000 retained messages on a `#` subscribe the Python loop took
 * ~270 us of the broker's ~1,500 us (six list appends, a dict lookup and a few tuple reads per
 * message); here it is one pass to size the packets and one to write them into a single bytes.
 *
 * The Python reference, `encode_publish_run_py`, defines the behaviour; tests compare the two on
 * arbitrary input (tests/mqtt/test_publish_run_accel.py), errors included.
 *
 *   encode_publish_run(msgs, version, max_packet=0) -> (bytes, dropped)
 *       msgs: a list or tuple of (topic: str, payload: bytes-like, qos: 0..2, retain, packet id or
 *       None). Each becomes a PUBLISH (fixed header, topic, packet id when qos > 0, an empty MQTT 5
 *       property block when version == 5, payload); those larger than max_packet (0 = none) are
 *       left out and counted in `dropped`.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#define VARINT_MAX 268435455L

static Py_ssize_t varint_len(Py_ssize_t n) {
    return n < 128 ? 1 : n < 16384 ? 2 : n < 2097152 ? 3 : 4;
}

typedef struct {
    const char *topic;
    Py_ssize_t tlen;
    Py_buffer payload;
    int qos, retain;
    long pid;
    Py_ssize_t rl;     /* remaining length; -1: left out (over max_packet) */
} Item;

static void release(Item *items, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) PyBuffer_Release(&items[i].payload);
}

/* read and check message i; 0 on success, -1 with an exception set */
static int read_item(PyObject *m, Item *it, int extra) {
    if (!PyTuple_Check(m) || PyTuple_GET_SIZE(m) != 5) {
        PyErr_SetString(PyExc_TypeError, "each message must be a (topic, payload, qos, retain, packet id) tuple");
        return -1;
    }
    PyObject *topic = PyTuple_GET_ITEM(m, 0);
    if (!PyUnicode_Check(topic)) {
        PyErr_SetString(PyExc_TypeError, "topic must be a str");
        return -1;
    }
    it->topic = PyUnicode_AsUTF8AndSize(topic, &it->tlen);
    if (!it->topic) return -1;
    if (it->tlen > 0xFFFF) {
        PyErr_Format(PyExc_ValueError, "topic is %zd bytes in UTF-8, more than 65535", it->tlen);
        return -1;
    }
    long qos = PyLong_AsLong(PyTuple_GET_ITEM(m, 2));
    if (qos == -1 && PyErr_Occurred()) return -1;
    if (qos < 0 || qos > 2) {
        PyErr_Format(PyExc_ValueError, "qos must be 0, 1 or 2, got %ld", qos);
        return -1;
    }
    it->qos = (int)qos;
    int retain = PyObject_IsTrue(PyTuple_GET_ITEM(m, 3));
    if (retain < 0) return -1;
    it->retain = retain;
    it->pid = 0;
    if (qos) {
        PyObject *pid = PyTuple_GET_ITEM(m, 4);
        long p = pid == Py_None ? -1 : PyLong_AsLong(pid);
        if (p == -1 && PyErr_Occurred()) return -1;
        if (p < 1 || p > 0xFFFF) {
            if (pid == Py_None)
                PyErr_SetString(PyExc_ValueError, "packet id must be 1..65535, got None");
            else
                PyErr_Format(PyExc_ValueError, "packet id must be 1..65535, got %ld", p);
            return -1;
        }
        it->pid = p;
    }
    if (PyObject_GetBuffer(PyTuple_GET_ITEM(m, 1), &it->payload, PyBUF_SIMPLE) < 0) return -1;
    Py_ssize_t rl = 2 + it->tlen + extra + it->payload.len + (qos ? 2 : 0);
    if (rl > VARINT_MAX) {
        PyBuffer_Release(&it->payload);
        PyErr_Format(PyExc_ValueError, "variable byte integer %zd exceeds the maximum %ld", rl, VARINT_MAX);
        return -1;
    }
    it->rl = rl;
    return 0;
}

static PyObject *encode_publish_run(PyObject *self, PyObject *args) {
    PyObject *msgs;
    int version;
    Py_ssize_t max_packet = 0;
    if (!PyArg_ParseTuple(args, "Oi|n", &msgs, &version, &max_packet)) return NULL;
    PyObject *seq = PySequence_Fast(msgs, "msgs must be a list or tuple");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    int extra = version == 5 ? 1 : 0;
    Item small[64];
    Item *its = n <= 64 ? small : PyMem_Malloc(sizeof(Item) * (size_t)n);
    if (!its) { Py_DECREF(seq); return PyErr_NoMemory(); }
    Py_ssize_t done = 0, total = 0, dropped = 0;
    PyObject *out = NULL, *result = NULL;
    for (; done < n; done++) {
        Item *it = &its[done];
        if (read_item(items[done], it, extra) < 0) goto fail;
        Py_ssize_t size = 1 + varint_len(it->rl) + it->rl;
        if (max_packet && size > max_packet) {
            it->rl = -1;
            dropped++;
            continue;
        }
        total += size;
    }
    out = PyBytes_FromStringAndSize(NULL, total);
    if (!out) goto fail;
    unsigned char *w = (unsigned char *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        Item *it = &its[i];
        Py_ssize_t rl = it->rl;
        if (rl < 0) continue;
        *w++ = (unsigned char)(0x30 | (it->qos << 1) | (it->retain ? 1 : 0));
        do {
            unsigned char b = rl & 0x7F;
            rl >>= 7;
            *w++ = rl ? (b | 0x80) : b;
        } while (rl);
        *w++ = (unsigned char)(it->tlen >> 8);
        *w++ = (unsigned char)(it->tlen & 0xFF);
        memcpy(w, it->topic, (size_t)it->tlen);
        w += it->tlen;
        if (it->qos) {
            *w++ = (unsigned char)(it->pid >> 8);
            *w++ = (unsigned char)(it->pid & 0xFF);
        }
        if (extra) *w++ = 0;
        memcpy(w, it->payload.buf, (size_t)it->payload.len);
        w += it->payload.len;
    }
    result = Py_BuildValue("(Nn)", out, dropped);
    out = NULL;
fail:
    Py_XDECREF(out);
    release(its, done);
    if (its != small) PyMem_Free(its);
    Py_DECREF(seq);
    return result;
}

static PyMethodDef methods[] = {
    {"encode_publish_run", encode_publish_run, METH_VARARGS,
     "encode_publish_run(msgs, version, max_packet=0) -> (bytes, dropped): see encoder.encode_publish_run_py"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_run", NULL, -1, methods};

PyMODINIT_FUNC PyInit__run(void) { return PyModule_Create(&module); }
