/* Parked idle MQTT sockets (gateway/net/parking.py has the pure-Python reference, `PyParker`,
 * with the same interface and behaviour; docs/gateway.md "Idle connections").
 *
 * A parked socket is a connected client's TCP socket that left the event loop's transports:
 * this module watches it with one epoll of its own (whose fd the event loop watches), answers
 * PINGREQ (0xC0 0x00) with PINGRESP (0xD0 0x00) itself, remembers when it last read a byte, and
 * hands the socket back (`poll` returns it) on anything else: other bytes (returned intact, in
 * order, the first of them possibly the 0xC0 of a PINGREQ split across reads), EOF or an error.
 * What it keeps per socket: one `Slot` in an array indexed by fd (24 bytes) and the kernel's
 * epoll entry.
 *
 *   Parker()                  an epoll of its own
 *   .fileno()                 the epoll's fd (readable when a parked socket is)
 *   .add(fd, owner)           watch `fd` (non-blocking, connected) for `owner`
 *   .remove(fd) -> (owner, pending) | None   stop watching (not closed); `pending`: bytes read
 *                             and not answered (b"" or b"\xc0")
 *   .idle(fd) -> float        seconds since its last byte (or since `add`)
 *   .poll(max_events=256) -> [(owner, fd, data, eof)]   sockets handed back (no longer watched)
 *   .pings                    PINGRESPs answered so far
 *   (fd arguments: any int, as PyParker takes them: one outside the C int range is no fd, so never
 *   parked; max_events: any int, clamped to [1, 1024])
 *   len(parker), .close()
 *   trim() -> bool            malloc_trim(0): give the heap's free pages back to the system (the
 *                             transports of connections just parked were freed; without it the
 *                             process keeps their pages)
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <limits.h>
#include <malloc.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    PyObject *owner;       /* NULL: the fd is not parked here */
    double last;           /* CLOCK_MONOTONIC seconds of the last byte read */
    unsigned char pending; /* 1: a lone 0xC0 was read (a PINGREQ split across reads) */
} Slot;

typedef struct {
    PyObject_HEAD
    int epfd;
    Slot *slots;
    Py_ssize_t cap;
    Py_ssize_t count;
    unsigned long long pings;
} Parker;

#define READ_BUF 4096
#define MAX_READS 16      /* reads of one socket per poll: a PINGREQ flood waits for the next poll */

static unsigned char PONGS[READ_BUF];   /* 0xD0 0x00 repeated */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static Slot *slot_of(Parker *self, int fd) {
    if (fd < 0 || fd >= self->cap || self->slots[fd].owner == NULL)
        return NULL;
    return &self->slots[fd];
}

/* The parked slot of the Python int `arg`, or NULL: an int outside the C int range is no fd, so
 * not parked (as for PyParker's dict), never the fd its low bits would truncate to. -1 in *err
 * with an exception set when `arg` is not an int. */
static Slot *slot_of_arg(Parker *self, PyObject *arg, int *fd, int *err) {
    int overflow;
    long v = PyLong_AsLongAndOverflow(arg, &overflow);
    *err = 0;
    if (v == -1 && PyErr_Occurred()) {
        *err = -1;
        return NULL;
    }
    if (overflow || v < INT_MIN || v > INT_MAX)
        return NULL;
    *fd = (int)v;
    return slot_of(self, *fd);
}

static void unwatch(Parker *self, int fd) {
    if (self->epfd >= 0)
        epoll_ctl(self->epfd, EPOLL_CTL_DEL, fd, NULL);
    self->slots[fd].owner = NULL;
    self->slots[fd].pending = 0;
    self->count--;
}

static int Parker_init(Parker *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "", kwlist))
        return -1;
    if (self->epfd < 0) {
        self->epfd = epoll_create1(EPOLL_CLOEXEC);
        if (self->epfd < 0) {
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
    }
    return 0;
}

static PyObject *Parker_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    Parker *self = (Parker *)type->tp_alloc(type, 0);
    if (self != NULL) {
        self->epfd = -1;
        self->slots = NULL;
        self->cap = 0;
        self->count = 0;
        self->pings = 0;
    }
    return (PyObject *)self;
}

static int Parker_traverse(Parker *self, visitproc visit, void *arg) {
    for (Py_ssize_t i = 0; i < self->cap; i++)
        Py_VISIT(self->slots[i].owner);
    return 0;
}

static int Parker_clear(Parker *self) {
    for (Py_ssize_t i = 0; i < self->cap; i++)
        Py_CLEAR(self->slots[i].owner);
    self->count = 0;
    return 0;
}

static void Parker_dealloc(Parker *self) {
    PyObject_GC_UnTrack(self);
    Parker_clear(self);
    if (self->epfd >= 0)
        close(self->epfd);
    PyMem_Free(self->slots);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Parker_fileno(Parker *self, PyObject *unused) {
    if (self->epfd < 0) {
        PyErr_SetString(PyExc_ValueError, "parker is closed");
        return NULL;
    }
    return PyLong_FromLong(self->epfd);
}

static PyObject *Parker_add(Parker *self, PyObject *args) {
    PyObject *fd_o, *owner;
    if (!PyArg_ParseTuple(args, "OO", &fd_o, &owner))
        return NULL;
    int overflow;
    long v = PyLong_AsLongAndOverflow(fd_o, &overflow);
    if (v == -1 && PyErr_Occurred())
        return NULL;
    if (self->epfd < 0) {
        PyErr_SetString(PyExc_ValueError, "parker is closed");
        return NULL;
    }
    if (overflow > 0 || (!overflow && v > INT_MAX)) {   /* no fd (PyParker: select.epoll's OverflowError) */
        PyErr_Format(PyExc_OverflowError, "fd %S does not fit a C int", fd_o);
        return NULL;
    }
    if (overflow < 0 || v < 0) {         /* any negative int, as PyParker: ValueError */
        PyErr_Format(PyExc_ValueError, "bad fd %S", fd_o);
        return NULL;
    }
    int fd = (int)v;
    if (slot_of(self, fd) != NULL) {
        PyErr_Format(PyExc_ValueError, "fd %d is already parked", fd);
        return NULL;
    }
    /* the kernel first: an fd it refuses (not open, a regular file, the epoll itself) is refused
     * with its error before the slot array grows to that fd's number */
    struct epoll_event ev;
    memset(&ev, 0, sizeof ev);
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    if (epoll_ctl(self->epfd, EPOLL_CTL_ADD, fd, &ev) < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    if (fd >= self->cap) {
        Py_ssize_t cap = self->cap ? self->cap : 1024;
        while (cap <= fd)
            cap *= 2;
        Slot *s = PyMem_Realloc(self->slots, (size_t)cap * sizeof(Slot));
        if (s == NULL) {
            epoll_ctl(self->epfd, EPOLL_CTL_DEL, fd, NULL);
            return PyErr_NoMemory();
        }
        memset(s + self->cap, 0, (size_t)(cap - self->cap) * sizeof(Slot));
        self->slots = s;
        self->cap = cap;
    }
    Py_INCREF(owner);
    self->slots[fd].owner = owner;
    self->slots[fd].last = now_s();
    self->slots[fd].pending = 0;
    self->count++;
    Py_RETURN_NONE;
}

static PyObject *Parker_remove(Parker *self, PyObject *arg) {
    int fd, err;
    Slot *s = slot_of_arg(self, arg, &fd, &err);
    if (err < 0)
        return NULL;
    if (s == NULL)
        Py_RETURN_NONE;
    PyObject *owner = s->owner;          /* the slot's reference goes to the tuple */
    PyObject *pending = PyBytes_FromStringAndSize("\xc0", s->pending ? 1 : 0);
    if (pending == NULL)
        return NULL;
    unwatch(self, fd);
    PyObject *t = PyTuple_Pack(2, owner, pending);
    Py_DECREF(owner);
    Py_DECREF(pending);
    return t;
}

static PyObject *Parker_idle(Parker *self, PyObject *arg) {
    int fd, err;
    Slot *s = slot_of_arg(self, arg, &fd, &err);
    if (err < 0)
        return NULL;
    if (s == NULL) {
        PyErr_Format(PyExc_KeyError, "fd %S is not parked", arg);
        return NULL;
    }
    return PyFloat_FromDouble(now_s() - s->last);
}

/* Read what `fd` has. Returns 0: stays parked; 1: hand back (`*rest` the bytes, `*eof`). */
static int serve(Parker *self, int fd, Slot *s, PyObject **rest, int *eof) {
    unsigned char buf[READ_BUF];
    for (int reads = 0; reads < MAX_READS; reads++) {
        size_t off = 0;
        if (s->pending)
            buf[off++] = 0xC0;
        ssize_t n = recv(fd, buf + off, sizeof buf - off, MSG_DONTWAIT);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return 0;
        if (n <= 0) {            /* EOF or an error (reset...): what was read, then the end */
            *eof = 1;
            *rest = PyBytes_FromStringAndSize((char *)buf, (Py_ssize_t)off);
            return 1;
        }
        s->last = now_s();
        size_t total = off + (size_t)n, i = 0, pongs = 0;
        while (i + 1 < total && buf[i] == 0xC0 && buf[i + 1] == 0x00) {
            i += 2;
            pongs++;
        }
        if (pongs) {
            ssize_t w;
            do {
                w = send(fd, PONGS, 2 * pongs, MSG_DONTWAIT | MSG_NOSIGNAL);
            } while (w < 0 && errno == EINTR);
            if (w != (ssize_t)(2 * pongs)) {
                /* an idle socket's send buffer is empty: a failed or short write means the
                   connection is broken (or the peer reads nothing): hand it back as ended */
                *eof = 1;
                *rest = PyBytes_FromStringAndSize((char *)buf + i, (Py_ssize_t)(total - i));
                return 1;
            }
            self->pings += pongs;
        }
        s->pending = 0;
        if (total - i == 1 && buf[i] == 0xC0) {
            s->pending = 1;
            continue;
        }
        if (total > i) {
            *rest = PyBytes_FromStringAndSize((char *)buf + i, (Py_ssize_t)(total - i));
            return 1;
        }
    }
    return 0;
}

static PyObject *Parker_poll(Parker *self, PyObject *args) {
    PyObject *max_o = NULL;
    if (!PyArg_ParseTuple(args, "|O", &max_o))
        return NULL;
    /* any int, clamped to [1, 1024] as PyParker does (a huge one is 1024, not an OverflowError) */
    int overflow = 0;
    long max_events = 256;
    if (max_o != NULL) {
        max_events = PyLong_AsLongAndOverflow(max_o, &overflow);
        if (max_events == -1 && PyErr_Occurred())
            return NULL;
    }
    if (self->epfd < 0)
        return PyList_New(0);
    if (overflow)
        max_events = overflow > 0 ? 1024 : 1;
    if (max_events < 1)
        max_events = 1;
    if (max_events > 1024)
        max_events = 1024;
    struct epoll_event evs[1024];
    int n;
    do {
        n = epoll_wait(self->epfd, evs, (int)max_events, 0);
    } while (n < 0 && errno == EINTR);
    if (n < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    for (int k = 0; k < n; k++) {
        int fd = evs[k].data.fd;
        Slot *s = slot_of(self, fd);
        if (s == NULL)
            continue;
        PyObject *rest = NULL;
        int eof = 0;
        if (!serve(self, fd, s, &rest, &eof))
            continue;
        if (rest == NULL)
            goto fail;
        PyObject *owner = s->owner;
        unwatch(self, fd);
        PyObject *t = Py_BuildValue("(NiNO)", owner, fd, rest, eof ? Py_True : Py_False);
        if (t == NULL)
            goto fail;
        int r = PyList_Append(out, t);
        Py_DECREF(t);
        if (r < 0)
            goto fail;
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

static PyObject *Parker_close(Parker *self, PyObject *unused) {
    Parker_clear(self);
    if (self->epfd >= 0) {
        close(self->epfd);
        self->epfd = -1;
    }
    Py_RETURN_NONE;
}

static Py_ssize_t Parker_len(Parker *self) { return self->count; }

static PyObject *Parker_get_pings(Parker *self, void *closure) {
    return PyLong_FromUnsignedLongLong(self->pings);
}

static PyMethodDef Parker_methods[] = {
    {"fileno", (PyCFunction)Parker_fileno, METH_NOARGS, "the epoll's fd"},
    {"add", (PyCFunction)Parker_add, METH_VARARGS, "add(fd, owner): watch fd"},
    {"remove", (PyCFunction)Parker_remove, METH_O, "remove(fd) -> (owner, pending bytes) or None"},
    {"idle", (PyCFunction)Parker_idle, METH_O, "idle(fd) -> seconds since its last byte"},
    {"poll", (PyCFunction)Parker_poll, METH_VARARGS, "poll(max_events=256) -> [(owner, fd, data, eof)]"},
    {"close", (PyCFunction)Parker_close, METH_NOARGS, "close the epoll (the parked fds stay open)"},
    {NULL}};

static PyGetSetDef Parker_getset[] = {
    {"pings", (getter)Parker_get_pings, NULL, "PINGRESPs answered", NULL},
    {NULL}};

static PySequenceMethods Parker_seq = {.sq_length = (lenfunc)Parker_len};

static PyTypeObject ParkerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "lmqtt.gateway.net._park.Parker",
    .tp_basicsize = sizeof(Parker),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "parked idle MQTT sockets on an epoll of their own",
    .tp_new = Parker_new,
    .tp_init = (initproc)Parker_init,
    .tp_dealloc = (destructor)Parker_dealloc,
    .tp_traverse = (traverseproc)Parker_traverse,
    .tp_clear = (inquiry)Parker_clear,
    .tp_methods = Parker_methods,
    .tp_getset = Parker_getset,
    .tp_as_sequence = &Parker_seq,
};

static PyObject *park_trim(PyObject *m, PyObject *unused) {
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = malloc_trim(0);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(r);
}

static PyMethodDef module_methods[] = {
    {"trim", park_trim, METH_NOARGS, "malloc_trim(0): free heap pages back to the system"},
    {NULL}};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_park", "parked idle MQTT sockets", -1, module_methods};

PyMODINIT_FUNC PyInit__park(void) {
    for (size_t i = 0; i < READ_BUF; i += 2) {
        PONGS[i] = 0xD0;
        PONGS[i + 1] = 0x00;
    }
    if (PyType_Ready(&ParkerType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&moddef);
    if (m == NULL)
        return NULL;
    Py_INCREF(&ParkerType);
    if (PyModule_AddObject(m, "Parker", (PyObject *)&ParkerType) < 0) {
        Py_DECREF(&ParkerType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
