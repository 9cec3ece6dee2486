/* Layout checks shared by the store's C accelerators (store/_append.c, store/_fastpath.c,
 * store/client/_records.c, store/spark/_columns.c), and the CommitLog record head they all read.
 *
 * Why: each of those loops reads fixed offsets of a struct whose one definition is in Python
 * (store/record.py HEADER and HEADER_FIELDS, store/consume_queue.py ENTRY, store/protocol.py
 * REC_HEAD). The Python side hands its formats to the module's configure() at import, and
 * configure() compares them, field by field, with the offsets the C code was written for, so a
 * layout changed on one side only is refused by name instead of decoding wrong data. The
 * comparison lives here once, and so does the table of the CommitLog record head (below), which
 * four of them read; each module keeps its own table of the other fields it reads and the phrase
 * naming itself in the messages ("these loops read", "this decoder reads", ...).
 *
 * Requires Python.h before it. Everything is static (inline): each module gets its own copy. */
#ifndef LMQTT_STORE_LAYOUT_H
#define LMQTT_STORE_LAYOUT_H

#include <structmember.h>     /* T_OBJECT_EX, PyMemberDescrObject: slot_offset below */

typedef struct { const char *name; int offset; int width; } field_t;
#define N_FIELDS(a) ((int)(sizeof a / sizeof a[0]))

/* The CommitLog record head (store/record.py HEADER and HEADER_FIELDS, little-endian; docs/store.md):
 * each field's byte offset, in the order of HEADER, and F_END its size. The modules that read or
 * write it (_append, _records, _columns' raw walk, _fastpath's first three fields) step by F_END and
 * read at these offsets; their configure() checks the Python format and names against
 * record_head_fields. */
enum { F_TOTAL = 0, F_MAGIC = 4, F_CRC = 8, F_QID = 12, F_FLAGS = 16, F_QOFF = 20, F_PHYS = 28,
       F_BORN = 36, F_STORE = 44, F_TAGS = 52, F_BODY_LEN = 60, F_PROPS_LEN = 64, F_TOPIC_LEN = 68,
       F_KEYS_LEN = 70, F_DQ_LEN = 72, F_END = 74 };
static const field_t record_head_fields[] = {
    {"total_size", F_TOTAL, 4}, {"magic", F_MAGIC, 4}, {"crc", F_CRC, 4}, {"queue_id", F_QID, 4},
    {"flags", F_FLAGS, 4}, {"queue_offset", F_QOFF, 8}, {"phys_offset", F_PHYS, 8}, {"born_ts", F_BORN, 8},
    {"store_ts", F_STORE, 8}, {"tags_code", F_TAGS, 8}, {"body_len", F_BODY_LEN, 4},
    {"props_len", F_PROPS_LEN, 4}, {"topic_len", F_TOPIC_LEN, 2}, {"keys_len", F_KEYS_LEN, 2},
    {"dq_len", F_DQ_LEN, 2}};
_Static_assert(F_DQ_LEN + 2 == F_END, "record_head_fields end at F_END");

/* layout[key] as a str (its UTF-8, owned by the dict's value), or NULL with ValueError. */
static inline const char *layout_str(PyObject *layout, const char *key) {
    PyObject *v = PyDict_GetItemString(layout, key);
    if (v == NULL || !PyUnicode_Check(v)) {
        PyErr_Format(PyExc_ValueError, "configure: layout has no str %s", key);
        return NULL;
    }
    return PyUnicode_AsUTF8(v);
}

/* layout[key] as an int into *out; -1 with ValueError if it is missing or not an int. */
static inline int layout_int(PyObject *layout, const char *key, long long *out) {
    PyObject *v = PyDict_GetItemString(layout, key);
    if (v == NULL || !PyLong_Check(v)) {
        PyErr_Format(PyExc_ValueError, "configure: layout has no int %s", key);
        return -1;
    }
    *out = PyLong_AsLongLong(v);
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

/* The fields of a struct format made of Q, I and H codes behind the byte-order mark `order` ('<'
 * or '>'): fills offs[] and widths[] (at most max entries) and returns the field count, with
 * *size the total; -1 if the format has another byte order or another code. */
static inline int format_fields(const char *fmt, char order, int *offs, int *widths, int max, long long *size) {
    int n = 0;
    long long at = 0;
    if (*fmt != order) return -1;
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

/* Check that `fmt` (a struct format from Python; `what` names the struct) starts with the fields
 * `want` (is exactly them when `exact`), with *size its total; ValueError naming the first field
 * that differs. `reads` names the module in the message ("these loops read"). */
static inline int check_format(const char *what, const char *fmt, char order, const field_t *want, int nwant,
                               int exact, long long *size, const char *reads) {
    int offs[64], widths[64];
    int n = format_fields(fmt, order, offs, widths, 64, size);
    if (n < 0) {
        PyErr_Format(PyExc_ValueError, "configure: %s format %s is not %s Q/I/H fields, the layout %s",
                     what, fmt, order == '<' ? "little-endian" : "big-endian", reads);
        return -1;
    }
    if (exact ? n != nwant : n < nwant) {
        PyErr_Format(PyExc_ValueError, "configure: %s format %s has %d fields, %s %s%d", what, fmt, n, reads,
                     exact ? "" : "at least ", nwant);
        return -1;
    }
    for (int i = 0; i < nwant; i++)
        if (offs[i] != want[i].offset || widths[i] != want[i].width) {
            PyErr_Format(PyExc_ValueError, "configure: %s field %d (%s) is %d bytes at offset %d in %s, "
                         "%s %d bytes at offset %d", what, i, want[i].name, widths[i], offs[i], fmt, reads,
                         want[i].width, want[i].offset);
            return -1;
        }
    return 0;
}

/* Check layout[fmt_key] (a struct format, all of whose fields are `want`) and layout[size_key]
 * (its size in bytes, which must be `head`, the size the module steps by). */
static inline int check_struct(PyObject *layout, const char *what, const char *fmt_key, const char *size_key,
                               char order, const field_t *want, int nwant, long long head, const char *reads) {
    long long size, fsize;
    const char *fmt = layout_str(layout, fmt_key);
    if (fmt == NULL || layout_int(layout, size_key, &size) < 0) return -1;
    if (check_format(what, fmt, order, want, nwant, 1, &fsize, reads) < 0) return -1;
    if (size != fsize || size != head) {
        PyErr_Format(PyExc_ValueError, "configure: %s %s %lld, the format %s is %lld bytes and %s %lld", what,
                     size_key, size, fmt, fsize, reads, head);
        return -1;
    }
    return 0;
}

/* Check that the field names `names` (a tuple of str from Python; `what` names the struct) start
 * with the names of `want` (are exactly them when `exact`); ValueError naming the first that
 * differs. Catches a reorder of two fields of the same width, which offsets alone do not. */
static inline int check_names(const char *what, PyObject *names, const field_t *want, int nwant, int exact,
                              const char *reads) {
    if (names == NULL || !PyTuple_Check(names)) {
        PyErr_Format(PyExc_ValueError, "configure: layout has no tuple of %s field names", what);
        return -1;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(names);
    if (exact ? n != nwant : n < nwant) {
        PyErr_Format(PyExc_ValueError, "configure: %s has %zd field names, %s %s%d", what, n, reads,
                     exact ? "" : "at least ", nwant);
        return -1;
    }
    for (int i = 0; i < nwant; i++) {
        PyObject *f = PyTuple_GET_ITEM(names, i);
        if (!PyUnicode_Check(f) || PyUnicode_CompareWithASCIIString(f, want[i].name) != 0) {
            PyErr_Format(PyExc_ValueError, "configure: %s field %d is %R, %s %s there", what, i, f, reads,
                         want[i].name);
            return -1;
        }
    }
    return 0;
}

/* The DispatchRequest fields (store/message.py) in the order the C loops that build one fill it
 * (_append.c's encoder, _fastpath.c's dispatch scan). */
static const char *const dr_fields[] = {"phys_offset", "size", "topic", "queue_id", "queue_offset", "flags",
                                        "born_ts", "store_ts", "tags_code", "keys", "dispatch_queues"};
#define N_DR_FIELDS ((Py_ssize_t)(sizeof dr_fields / sizeof dr_fields[0]))

/* Whether the named tuple type `type` has exactly the fields `names` in this order: 1 yes, 0 no,
 * -1 with an error set (no `_fields`). The loops fill those tuples by position, so a reordered or
 * renamed field must make configure() refuse (the caller raises ValueError naming the order). */
static inline int fields_match(PyObject *type, const char *const *names, Py_ssize_t n) {
    PyObject *fields = PyObject_GetAttrString(type, "_fields");
    if (fields == NULL) return -1;
    int ok = PyTuple_Check(fields) && PyTuple_GET_SIZE(fields) == n;
    for (Py_ssize_t i = 0; ok && i < n; i++) {
        PyObject *f = PyTuple_GET_ITEM(fields, i);
        ok = PyUnicode_Check(f) && PyUnicode_CompareWithASCIIString(f, names[i]) == 0;
    }
    Py_DECREF(fields);
    return ok;
}

/* The byte offset of the object slot `name` of the class `tp` (a `__slots__` member holding any
 * object), or -1 if `tp` has no such slot: the loops that read or write store.message.Message by
 * slot (_append's encoder, _produce's codec) take the offsets from the class at configure(), so a
 * renamed or removed slot is refused by name rather than read at a stale offset. */
static inline Py_ssize_t slot_offset(PyTypeObject *tp, const char *name) {
    PyObject *d = PyDict_GetItemString(tp->tp_dict, name);
    if (d == NULL || Py_TYPE(d) != &PyMemberDescr_Type) return -1;
    PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
    if (m->type != T_OBJECT_EX) return -1;
    return m->offset;
}

#endif
