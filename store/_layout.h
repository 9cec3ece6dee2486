/* Layout checks shared by the store's C accelerators (store/_fastpath.c, store/client/_records.c,
 * store/spark/_columns.c).
 *
 * Why: each of those loops reads fixed offsets of a struct whose one definition is in Python
 * (store/record.py HEADER and HEADER_FIELDS, store/consume_queue.py ENTRY, store/protocol.py
 * REC_HEAD). The Python side hands its formats to the module's configure() at import, and
 * configure() compares them, field by field, with the offsets the C code was written for, so a
 * layout changed on one side only is refused by name instead of decoding wrong data. The
 * comparison lives here once; each module keeps its own table of the fields it reads and the
 * phrase naming itself in the messages ("these loops read", "this decoder reads", ...).
 *
 * Requires Python.h before it. Everything is static inline: each module gets its own copy. */
#ifndef LMQTT_STORE_LAYOUT_H
#define LMQTT_STORE_LAYOUT_H

typedef struct { const char *name; int offset; int width; } field_t;
#define N_FIELDS(a) ((int)(sizeof a / sizeof a[0]))

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

#endif
