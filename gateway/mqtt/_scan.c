/* lmqtt.gateway.mqtt._scan: the steady state of gateway/mqtt/decoder.py's `Decoder.feed` in C.
 *
 * Why: every byte a client sends goes through `Decoder.feed`, and in the steady state that is a
 * run of PUBLISHes (a publisher) or of two-byte acks (a QoS 1/2 subscriber). Profiled at 5,000
 * msg/s (50 pairs, QoS 1) the decoder's per-packet Python (`feed`'s loop, `_publish`, the ack
 * fast path: bounds, the remaining-length varint, slicing, UTF-8, the packet's __init__) was
 * ~8 % of the broker's CPU per message, and in a QoS 0 fan-in, where nothing else per message is
 * written, more. Here a read's packets are framed by the plain-C core (_scan_core.h, the code
 * the libFuzzer harness tests/fuzz/scan_fuzz.c runs under AddressSanitizer) and built straight
 * into the packet classes' slots.
 *
 * The Python decoder is the reference and keeps every decision that can fail: this module only
 * takes packets the reference would accept, and stops at the first it is not sure of (anything
 * but PUBLISH without MQTT 5 properties and two-byte acks, an incomplete packet, a rule broken,
 * a topic that is not strict UTF-8 or holds U+0000 or a wildcard); `feed` then goes on with its
 * own loop from there, so errors and their messages are the reference's.
 * tests/mqtt/test_scan_accel.py compares the two on arbitrary byte streams cut anywhere.
 *
 *   configure(Publish, PubAck, PubRec, PubRel, PubComp, Properties)
 *       the packet classes (gateway/mqtt/packets.py): their slots are checked by name and order
 *       (ValueError naming the first difference); until a configure succeeds scan raises.
 *   scan(buf, pos, out, ok, v5, max_packet, empty_props) -> new pos
 *       appends the packets taken from bytearray `buf` at `pos` to list `out`; `ok`: the
 *       decoder's 256-byte first-byte table; `empty_props`: the shared empty Properties for
 *       packets without properties, or None for a new one each (as the reference does).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <string.h>

#include "_scan_core.h"

#define BATCH 64

enum { PUBLISH_FIELDS = 7, ACK_FIELDS = 3 };
static const char *publish_names[PUBLISH_FIELDS] = {"topic", "payload", "qos", "retain", "dup",
                                                     "packet_id", "properties"};
static const char *ack_names[ACK_FIELDS] = {"packet_id", "reason_code", "properties"};

typedef struct {
    PyTypeObject *cls;
    Py_ssize_t off[PUBLISH_FIELDS];
} Shape;

static Shape publish_shape, ack_shape[4];    /* PUBACK, PUBREC, PUBREL, PUBCOMP */
static PyObject *properties_cls = NULL;
static int configured = 0;
static PyObject *small_qos[3];

/* the slot offsets of `cls`'s fields `names`, in that order, read from its member descriptors */
static int read_shape(PyObject *cls, const char **names, int n, Shape *sh) {
    if (!PyType_Check(cls)) {
        PyErr_SetString(PyExc_TypeError, "configure: packet classes must be classes");
        return -1;
    }
    PyObject *slots = PyObject_GetAttrString(cls, "__slots__");
    if (!slots) return -1;
    PyObject *seq = PySequence_Fast(slots, "__slots__ must be a sequence");
    Py_DECREF(slots);
    if (!seq) return -1;
    if (PySequence_Fast_GET_SIZE(seq) != n) {
        PyErr_Format(PyExc_ValueError, "configure: %s has %zd fields, _scan.c reads %d",
                     ((PyTypeObject *)cls)->tp_name, PySequence_Fast_GET_SIZE(seq), n);
        Py_DECREF(seq);
        return -1;
    }
    for (int k = 0; k < n; k++) {
        PyObject *name = PySequence_Fast_GET_ITEM(seq, k);
        if (!PyUnicode_Check(name) || PyUnicode_CompareWithASCIIString(name, names[k]) != 0) {
            PyErr_Format(PyExc_ValueError, "configure: field %d of %s is %R, _scan.c reads %s", k,
                         ((PyTypeObject *)cls)->tp_name, name, names[k]);
            Py_DECREF(seq);
            return -1;
        }
        PyObject *d = PyObject_GetAttr(cls, name);
        if (!d) { Py_DECREF(seq); return -1; }
        if (Py_TYPE(d) != &PyMemberDescr_Type) {
            PyErr_Format(PyExc_ValueError, "configure: %s.%s is not a slot", ((PyTypeObject *)cls)->tp_name,
                         names[k]);
            Py_DECREF(d);
            Py_DECREF(seq);
            return -1;
        }
        PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
        if (m->type != T_OBJECT_EX) {
            PyErr_Format(PyExc_ValueError, "configure: %s.%s is not an object slot",
                         ((PyTypeObject *)cls)->tp_name, names[k]);
            Py_DECREF(d);
            Py_DECREF(seq);
            return -1;
        }
        sh->off[k] = m->offset;
        Py_DECREF(d);
    }
    Py_DECREF(seq);
    sh->cls = (PyTypeObject *)cls;
    return 0;
}

static PyObject *configure(PyObject *self, PyObject *args) {
    PyObject *pub, *acks[4], *props;
    if (!PyArg_ParseTuple(args, "OOOOOO", &pub, &acks[0], &acks[1], &acks[2], &acks[3], &props)) return NULL;
    configured = 0;
    Shape ps, as[4];
    if (read_shape(pub, publish_names, PUBLISH_FIELDS, &ps) < 0) return NULL;
    for (int k = 0; k < 4; k++)
        if (read_shape(acks[k], ack_names, ACK_FIELDS, &as[k]) < 0) return NULL;
    if (!PyCallable_Check(props)) {
        PyErr_SetString(PyExc_TypeError, "configure: Properties must be callable");
        return NULL;
    }
    Py_XDECREF((PyObject *)publish_shape.cls);
    for (int k = 0; k < 4; k++) Py_XDECREF((PyObject *)ack_shape[k].cls);
    Py_XDECREF(properties_cls);
    publish_shape = ps;
    Py_INCREF(pub);
    for (int k = 0; k < 4; k++) { ack_shape[k] = as[k]; Py_INCREF(acks[k]); }
    properties_cls = props;
    Py_INCREF(props);
    configured = 1;
    Py_RETURN_NONE;
}

static inline void put(PyObject *obj, Py_ssize_t off, PyObject *v) {
    *(PyObject **)((char *)obj + off) = v;     /* steals v */
}

/* a new instance of sh->cls with its slots set (each steals its value); NULL on error */
static PyObject *make(Shape *sh, PyObject **vals, int n) {
    PyObject *o = sh->cls->tp_alloc(sh->cls, 0);
    if (!o) {
        for (int k = 0; k < n; k++) Py_DECREF(vals[k]);
        return NULL;
    }
    for (int k = 0; k < n; k++) put(o, sh->off[k], vals[k]);
    return o;
}

static PyObject *props_for(PyObject *empty) {
    if (empty != Py_None) {
        Py_INCREF(empty);
        return empty;
    }
    return PyObject_CallNoArgs(properties_cls);
}

static PyObject *scan(PyObject *self, PyObject *args) {
    PyObject *bufobj, *out, *empty;
    Py_ssize_t pos, max_packet;
    Py_buffer okv;
    int v5;
    if (!PyArg_ParseTuple(args, "O!nO!y*pnO", &PyByteArray_Type, &bufobj, &pos, &PyList_Type, &out, &okv, &v5,
                          &max_packet, &empty))
        return NULL;
    if (!configured) {
        PyBuffer_Release(&okv);
        PyErr_SetString(PyExc_RuntimeError, "_scan is not configured (configure() failed or was not called)");
        return NULL;
    }
    if (okv.len != 256) {
        PyBuffer_Release(&okv);
        PyErr_SetString(PyExc_ValueError, "ok must be the 256-byte first-byte table");
        return NULL;
    }
    const uint8_t *ok = (const uint8_t *)okv.buf;
    Py_ssize_t n = PyByteArray_GET_SIZE(bufobj);
    if (pos < 0 || pos > n) {
        PyBuffer_Release(&okv);
        PyErr_SetString(PyExc_ValueError, "pos out of range");
        return NULL;
    }
    size_t mp = max_packet < 0 ? 0 : (size_t)max_packet;
    scan_frame fr[BATCH];
    /* the previous PUBLISH's topic: a connection mostly publishes to one topic, decoded once */
    PyObject *last_topic = NULL;
    size_t last_t = 0, last_tlen = 0;
    const uint8_t *lastbuf = NULL;
    for (;;) {
        /* the buffer is not resized while we hold no reference to Python code that could */
        const uint8_t *buf = (const uint8_t *)PyByteArray_AS_STRING(bufobj);
        n = PyByteArray_GET_SIZE(bufobj);
        size_t stop;
        size_t k = scan_frames(buf, (size_t)n, (size_t)pos, ok, v5, mp, fr, BATCH, &stop);
        size_t taken = 0;
        for (; taken < k; taken++) {
            scan_frame *f = &fr[taken];
            unsigned t = f->b0 >> 4;
            PyObject *pkt;
            if (t == 3) {
                PyObject *topic;
                if (last_topic && lastbuf == buf && last_tlen == f->tlen &&
                    memcmp(buf + last_t, buf + f->topic, f->tlen) == 0) {
                    topic = last_topic;
                    Py_INCREF(topic);
                } else {
                    topic = PyUnicode_DecodeUTF8((const char *)buf + f->topic, (Py_ssize_t)f->tlen, "strict");
                    if (!topic) {
                        if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) goto fail;
                        PyErr_Clear();
                        break;                        /* the reference says what is wrong */
                    }
                    Py_UCS4 bad[3] = {0, '+', '#'};
                    int refuse = 0;
                    for (int b = 0; b < 3 && !refuse; b++) {
                        Py_ssize_t at = PyUnicode_FindChar(topic, bad[b], 0, PyUnicode_GET_LENGTH(topic), 1);
                        if (at == -2) {
                            Py_DECREF(topic);
                            goto fail;
                        }
                        if (at != -1) refuse = 1;
                    }
                    if (refuse) {
                        Py_DECREF(topic);
                        break;
                    }
                    Py_XDECREF(last_topic);
                    last_topic = topic;
                    Py_INCREF(last_topic);
                    last_t = f->topic;
                    last_tlen = f->tlen;
                    lastbuf = buf;
                }
                unsigned qos = (f->b0 >> 1) & 3;
                PyObject *payload = PyBytes_FromStringAndSize((const char *)buf + f->payload, (Py_ssize_t)f->plen);
                PyObject *props = v5 ? PyObject_CallNoArgs(properties_cls) : props_for(empty);
                PyObject *pid = qos ? PyLong_FromLong(f->pid) : (Py_INCREF(Py_None), Py_None);
                if (!payload || !props || !pid) {
                    Py_DECREF(topic);
                    Py_XDECREF(payload);
                    Py_XDECREF(props);
                    Py_XDECREF(pid);
                    goto fail;
                }
                PyObject *vals[PUBLISH_FIELDS] = {topic, payload, small_qos[qos], PyBool_FromLong(f->b0 & 1),
                                                  PyBool_FromLong(f->b0 & 8), pid, props};
                Py_INCREF(small_qos[qos]);
                pkt = make(&publish_shape, vals, PUBLISH_FIELDS);
            } else {
                PyObject *pid = PyLong_FromLong(f->pid);
                PyObject *props = props_for(empty);
                if (!pid || !props) {
                    Py_XDECREF(pid);
                    Py_XDECREF(props);
                    goto fail;
                }
                PyObject *vals[ACK_FIELDS] = {pid, small_qos[0], props};
                Py_INCREF(small_qos[0]);
                pkt = make(&ack_shape[t - 4], vals, ACK_FIELDS);
            }
            if (!pkt) goto fail;
            int rc = PyList_Append(out, pkt);
            Py_DECREF(pkt);
            if (rc < 0) goto fail;
            pos = (Py_ssize_t)f->end;
        }
        if (taken < k || k < BATCH || (size_t)pos >= (size_t)n) break;
    }
    Py_XDECREF(last_topic);
    PyBuffer_Release(&okv);
    return PyLong_FromSsize_t(pos);
fail:
    Py_XDECREF(last_topic);
    PyBuffer_Release(&okv);
    return NULL;
}

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS, "configure(Publish, PubAck, PubRec, PubRel, PubComp, Properties)"},
    {"scan", scan, METH_VARARGS, "scan(buf, pos, out, ok, v5, max_packet, empty_props) -> new pos"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_scan", NULL, -1, methods};

PyMODINIT_FUNC PyInit__scan(void) {
    for (int q = 0; q < 3; q++) {
        small_qos[q] = PyLong_FromLong(q);
        if (!small_qos[q]) return NULL;
    }
    return PyModule_Create(&module);
}
