/* lightqueue._history: lightqueue/history.py's per-entry scan in C (optional accelerator).
 *
 * Why: a filter's history read from its first-level topic's ConsumeQueue (lightqueue/history.py)
 * looks at every entry of that queue and keeps the records whose topic matches the MQTT filter.
 * In Python that is a struct unpack, a slice, a decode and a split per record (~2 us); here it is
 * a few loads and a memcmp per level, and only matching records are CRC-checked and copied. The
 * Python function `scan_py` (history.py) is the reference and the fallback
 * (tests/history/test_history_scan.py compares the two on a real store; LMQTT_PURE_PYTHON=1
 * turns this off).
 *
 * match(filter: bytes, topic: bytes) -> bool      MQTT filter matching (lightqueue/topics.py rules)
 * scan(piece, first_qoff, segs, seg_size, filter, tag, phys_lo, phys_hi, ts_lo, ts_hi,
 *      max_count, max_bytes, out, idx) -> (count, next_qoff, bad, status)
 *
 *   piece: ConsumeQueue entries (<QIQ: phys, size, tags) from queue offset first_qoff.
 *   segs: [(start offset, buffer)] of the CommitLog's mapped segments, in order, seg_size bytes each.
 *   tag: the entries' tag code a record must have (an exact-topic filter), or -1 for any.
 *   Entries below phys_lo, unwritten ones (size 0), other tags and records outside [ts_lo, ts_hi)
 *   or not matching are passed over; the scan stops (status 1) at the first entry at/after
 *   phys_hi, or before the matching record that would pass max_count or max_bytes (0: no limit;
 *   never before the first). A matching record whose CRC or head does not check is counted in
 *   `bad` and passed over. A record whose segment is not mapped here stops the scan with status 2
 *   (the caller reads on through the store's decoding path). Matching records are appended to
 *   `out` as stored; (phys u64, size u64) per record to `idx`. next_qoff: the first entry not
 *   passed over. status 0: the piece was scanned to its end.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <zlib.h>

#include "../store/_layout.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_CLMUL 1
#include <immintrin.h>
#endif

#define ENTRY_SIZE 20
static int configured = 0;
static const uint32_t MSG_MAGIC = 0xDAA320A7u;
#define CRC_START 12

static const field_t entry_fields[] = {{"phys_offset", 0, 8}, {"size", 8, 4}, {"tags_code", 12, 8}};

static inline uint64_t le64(const unsigned char *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline uint32_t le32(const unsigned char *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint16_t le16(const unsigned char *p) { uint16_t v; memcpy(&v, p, 2); return v; }

/* MQTT filter `f` against topic `t` (both valid): lightqueue/topics.py topic_matches. */
static int match(const char *f, Py_ssize_t fl, const char *t, Py_ssize_t tl) {
    if (tl > 0 && t[0] == '$' && fl > 0 && (f[0] == '+' || f[0] == '#')) return 0;
    Py_ssize_t i = 0, j = 0;
    for (;;) {
        Py_ssize_t fe = i;
        while (fe < fl && f[fe] != '/') fe++;
        if (fe - i == 1 && f[i] == '#') return 1;       /* this level and all below, the parent too */
        if (j > tl) return 0;                           /* the topic has no level left */
        Py_ssize_t te = j;
        while (te < tl && t[te] != '/') te++;
        if (!(fe - i == 1 && f[i] == '+')) {
            if (fe - i != te - j || memcmp(f + i, t + j, (size_t)(fe - i)) != 0) return 0;
        }
        if (fe >= fl) return te >= tl;                   /* filter ends: the topic must end too */
        i = fe + 1;
        j = te < tl ? te + 1 : tl + 1;
    }
}

/* CRC-32 (zlib's) of the matching records: carry-less multiplication folding (PCLMULQDQ, Intel's
 * "Fast CRC Computation for Generic Polynomials Using PCLMULQDQ", the constants and steps of
 * Chromium's zlib crc32_simd.c) over the 16-byte blocks of a buffer of 64 bytes or more, zlib for
 * the rest and on CPUs without it. zlib 1.2.13's table CRC was a quarter of the store's CPU in a
 * filter-history read (1M matching records of 200 B among 10M, perf). `crc32(data)` exposes it so
 * that tests compare it with zlib.crc32. */
#ifdef HAVE_CLMUL
static int clmul_ok = -1;

__attribute__((target("pclmul,sse4.1")))
static uint32_t crc32_clmul(const unsigned char *buf, size_t len, uint32_t crc) {
    /* len >= 64, a multiple of 16; crc: the inverted running value (~crc) */
    static const uint64_t k1k2[2] __attribute__((aligned(16))) = {0x0154442bd4ULL, 0x01c6e41596ULL};
    static const uint64_t k3k4[2] __attribute__((aligned(16))) = {0x01751997d0ULL, 0x00ccaa009eULL};
    static const uint64_t k5k0[2] __attribute__((aligned(16))) = {0x0163cd6124ULL, 0x0000000000ULL};
    static const uint64_t poly[2] __attribute__((aligned(16))) = {0x01db710641ULL, 0x01f7011641ULL};
    __m128i x0, x1, x2, x3, x4, x5, x6, x7, x8, y5, y6, y7, y8;
    x1 = _mm_loadu_si128((const __m128i *)(buf + 0x00));
    x2 = _mm_loadu_si128((const __m128i *)(buf + 0x10));
    x3 = _mm_loadu_si128((const __m128i *)(buf + 0x20));
    x4 = _mm_loadu_si128((const __m128i *)(buf + 0x30));
    x1 = _mm_xor_si128(x1, _mm_cvtsi32_si128((int)crc));
    x0 = _mm_load_si128((const __m128i *)k1k2);
    buf += 64;
    len -= 64;
    while (len >= 64) {
        x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
        x6 = _mm_clmulepi64_si128(x2, x0, 0x00);
        x7 = _mm_clmulepi64_si128(x3, x0, 0x00);
        x8 = _mm_clmulepi64_si128(x4, x0, 0x00);
        x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
        x2 = _mm_clmulepi64_si128(x2, x0, 0x11);
        x3 = _mm_clmulepi64_si128(x3, x0, 0x11);
        x4 = _mm_clmulepi64_si128(x4, x0, 0x11);
        y5 = _mm_loadu_si128((const __m128i *)(buf + 0x00));
        y6 = _mm_loadu_si128((const __m128i *)(buf + 0x10));
        y7 = _mm_loadu_si128((const __m128i *)(buf + 0x20));
        y8 = _mm_loadu_si128((const __m128i *)(buf + 0x30));
        x1 = _mm_xor_si128(_mm_xor_si128(x1, x5), y5);
        x2 = _mm_xor_si128(_mm_xor_si128(x2, x6), y6);
        x3 = _mm_xor_si128(_mm_xor_si128(x3, x7), y7);
        x4 = _mm_xor_si128(_mm_xor_si128(x4, x8), y8);
        buf += 64;
        len -= 64;
    }
    x0 = _mm_load_si128((const __m128i *)k3k4);
    x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
    x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
    x1 = _mm_xor_si128(_mm_xor_si128(x1, x2), x5);
    x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
    x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
    x1 = _mm_xor_si128(_mm_xor_si128(x1, x3), x5);
    x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
    x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
    x1 = _mm_xor_si128(_mm_xor_si128(x1, x4), x5);
    while (len >= 16) {
        x2 = _mm_loadu_si128((const __m128i *)buf);
        x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
        x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
        x1 = _mm_xor_si128(_mm_xor_si128(x1, x2), x5);
        buf += 16;
        len -= 16;
    }
    /* 128 -> 64 bits */
    x2 = _mm_clmulepi64_si128(x1, x0, 0x10);
    x3 = _mm_setr_epi32(~0, 0, ~0, 0);
    x1 = _mm_srli_si128(x1, 8);
    x1 = _mm_xor_si128(x1, x2);
    x0 = _mm_loadl_epi64((const __m128i *)k5k0);
    x2 = _mm_srli_si128(x1, 4);
    x1 = _mm_and_si128(x1, x3);
    x1 = _mm_clmulepi64_si128(x1, x0, 0x00);
    x1 = _mm_xor_si128(x1, x2);
    /* Barrett reduction to 32 bits */
    x0 = _mm_load_si128((const __m128i *)poly);
    x2 = _mm_and_si128(x1, x3);
    x2 = _mm_clmulepi64_si128(x2, x0, 0x10);
    x2 = _mm_and_si128(x2, x3);
    x2 = _mm_clmulepi64_si128(x2, x0, 0x00);
    x1 = _mm_xor_si128(x1, x2);
    return (uint32_t)_mm_extract_epi32(x1, 1);
}
#endif

static uint32_t crc32_fast(const unsigned char *buf, size_t len) {
    uint32_t crc = 0;
#ifdef HAVE_CLMUL
    if (clmul_ok < 0) {
        __builtin_cpu_init();
        clmul_ok = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
    }
    if (clmul_ok && len >= 64) {
        size_t chunk = len & ~(size_t)15;
        crc = ~crc32_clmul(buf, chunk, ~crc);
        buf += chunk;
        len -= chunk;
        if (len == 0) return crc;
    }
#endif
    return (uint32_t)crc32(crc, buf, (uInt)len);
}

static PyObject *py_crc32(PyObject *self, PyObject *args) {
    Py_buffer b;
    if (!PyArg_ParseTuple(args, "y*", &b)) return NULL;
    uint32_t c = crc32_fast((const unsigned char *)b.buf, (size_t)b.len);
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLong(c);
}

/* The match of each distinct topic, once per scan call: a small open-addressed table keyed by the
 * entry's tag code (the CRC-32 of the topic the store puts in every ConsumeQueue entry), holding the
 * topic's bytes and its result. An entry is answered from it only when its record's topic is
 * byte-for-byte the cached one (a tag is a hash, never trusted alone), so the answer is always
 * match()'s; a topic longer than MC_TOPIC, or a full probe window, is simply matched. A filter read
 * of 10M entries of ~1,000 distinct topics: 10M memcmp instead of 10M level-by-level matches. */
#define MC_SLOTS 1024
#define MC_PROBE 8
#define MC_TOPIC 64
typedef struct {
    uint64_t tag;
    uint16_t len;
    int8_t used, result;
    char topic[MC_TOPIC];
} mc_slot;

static int match_cached(mc_slot *mc, uint64_t tag, const char *f, Py_ssize_t fl, const char *t, Py_ssize_t tl) {
    if (mc == NULL || tl > MC_TOPIC) return match(f, fl, t, tl);
    size_t h = (size_t)(tag ^ (tag >> 17)) & (MC_SLOTS - 1);
    for (int p = 0; p < MC_PROBE; p++) {
        mc_slot *s = &mc[(h + (size_t)p) & (MC_SLOTS - 1)];
        if (!s->used) {
            int r = match(f, fl, t, tl);
            s->used = 1;
            s->tag = tag;
            s->len = (uint16_t)tl;
            s->result = (int8_t)r;
            memcpy(s->topic, t, (size_t)tl);
            return r;
        }
        if (s->tag == tag && s->len == tl && memcmp(s->topic, t, (size_t)tl) == 0) return s->result;
    }
    return match(f, fl, t, tl);
}

static PyObject *py_match(PyObject *self, PyObject *args) {
    const char *f, *t;
    Py_ssize_t fl, tl;
    if (!PyArg_ParseTuple(args, "y#y#", &f, &fl, &t, &tl)) return NULL;
    return PyBool_FromLong(match(f, fl, t, tl));
}

static int ba_extend(PyObject *ba, const void *data, Py_ssize_t n) {
    Py_ssize_t len = PyByteArray_GET_SIZE(ba);
    if (PyByteArray_Resize(ba, len + n) < 0) return -1;
    memcpy(PyByteArray_AS_STRING(ba) + len, data, (size_t)n);
    return 0;
}

static PyObject *scan(PyObject *self, PyObject *args) {
    Py_buffer piece;
    long long first_qoff, seg_size, tag, phys_lo, phys_hi, ts_lo, ts_hi, max_count, max_bytes;
    PyObject *segs, *out, *idx;
    const char *flt;
    Py_ssize_t flt_len;
    if (!PyArg_ParseTuple(args, "y*LO!Ly#LLLLLLLO!O!", &piece, &first_qoff, &PyList_Type, &segs, &seg_size,
                          &flt, &flt_len, &tag, &phys_lo, &phys_hi, &ts_lo, &ts_hi, &max_count, &max_bytes,
                          &PyByteArray_Type, &out, &PyByteArray_Type, &idx))
        return NULL;
    if (!configured) {
        PyBuffer_Release(&piece);
        PyErr_SetString(PyExc_RuntimeError, "lmqtt.lightqueue._history.configure() was not called or failed");
        return NULL;
    }
    Py_ssize_t nseg = PyList_GET_SIZE(segs);
    long long first_start = 0;
    if (nseg > 0) {
        PyObject *s0 = PyList_GET_ITEM(segs, 0);
        if (!PyTuple_Check(s0) || PyTuple_GET_SIZE(s0) != 2) {
            PyBuffer_Release(&piece);
            PyErr_SetString(PyExc_TypeError, "segs: a list of (start offset, buffer)");
            return NULL;
        }
        first_start = PyLong_AsLongLong(PyTuple_GET_ITEM(s0, 0));
        if (first_start == -1 && PyErr_Occurred()) { PyBuffer_Release(&piece); return NULL; }
    }
    Py_buffer seg;
    Py_ssize_t seg_i = -1;           /* the segment whose buffer `seg` holds, -1: none */
    long long seg_start = 0;
    long long count = 0, bytes = 0, bad = 0;
    int status = 0;
    const unsigned char *e = (const unsigned char *)piece.buf;
    Py_ssize_t n = piece.len / ENTRY_SIZE;
    Py_ssize_t i = 0;
    int failed = 0;
    mc_slot *mc = n > 64 ? (mc_slot *)PyMem_Calloc(MC_SLOTS, sizeof(mc_slot)) : NULL;   /* NULL: no cache */
    for (; i < n; i++, e += ENTRY_SIZE) {
        uint64_t phys = le64(e);
        uint32_t size = le32(e + 8);
        if (size == 0 || (long long)phys < phys_lo) continue;
        if ((long long)phys >= phys_hi) { status = 1; break; }
        if (tag >= 0 && le64(e + 12) != (uint64_t)tag) continue;
        Py_ssize_t k = seg_size > 0 && (long long)phys >= first_start
                       ? (Py_ssize_t)(((long long)phys - first_start) / seg_size) : -1;
        if (k < 0 || k >= nseg) { status = 2; break; }
        if (k != seg_i) {
            if (seg_i >= 0) PyBuffer_Release(&seg);
            seg_i = -1;
            PyObject *st = PyList_GET_ITEM(segs, k);
            if (!PyTuple_Check(st) || PyTuple_GET_SIZE(st) != 2) { status = 2; break; }
            seg_start = PyLong_AsLongLong(PyTuple_GET_ITEM(st, 0));
            if (seg_start == -1 && PyErr_Occurred()) { failed = 1; break; }
            if (PyObject_GetBuffer(PyTuple_GET_ITEM(st, 1), &seg, PyBUF_SIMPLE) < 0) {
                PyErr_Clear();          /* a map closed by retention meanwhile: the decoding path */
                status = 2;
                break;
            }
            seg_i = k;
        }
        long long rel = (long long)phys - seg_start;
        if (rel < 0 || rel + (long long)size > seg.len || size < F_END) { status = 2; break; }
        const unsigned char *r = (const unsigned char *)seg.buf + rel;
        uint32_t tl = le16(r + F_TOPIC_LEN);
        if (le32(r + F_TOTAL) != size || le32(r + F_MAGIC) != MSG_MAGIC || (uint32_t)F_END + tl > size) {
            bad++;
            continue;
        }
        long long sts = (long long)le64(r + F_STORE);
        if (sts < ts_lo || sts >= ts_hi) continue;
        if (!match_cached(mc, le64(e + 12), flt, flt_len, (const char *)r + F_END, (Py_ssize_t)tl)) continue;
        if ((max_count > 0 && count >= max_count) || (max_bytes > 0 && count > 0 && bytes + size > max_bytes)) {
            status = 1;
            break;
        }
        if (crc32_fast(r + CRC_START, (size_t)(size - CRC_START)) != le32(r + F_CRC)) {
            bad++;
            continue;
        }
        uint64_t pair[2] = {phys, size};
        if (ba_extend(out, r, size) < 0 || ba_extend(idx, pair, sizeof pair) < 0) { failed = 1; break; }
        count++;
        bytes += size;
    }
    if (seg_i >= 0) PyBuffer_Release(&seg);
    PyBuffer_Release(&piece);
    PyMem_Free(mc);
    if (failed) return NULL;
    return Py_BuildValue("(LLLi)", count, first_qoff + (long long)i, bad, status);
}

#define READS "this scan reads"

/* configure(layout): {"cq_entry_format", "cq_entry_fields", "cq_entry_size", "record_header_format",
 * "record_header_fields", "record_magic", "crc_start"} (lightqueue/history.py C_LAYOUT). */
static PyObject *configure(PyObject *self, PyObject *args) {
    PyObject *layout;
    long long magic, crc_start;
    if (!PyArg_ParseTuple(args, "O!", &PyDict_Type, &layout)) return NULL;
    configured = 0;
    if (check_struct(layout, "ConsumeQueue entry", "cq_entry_format", "cq_entry_size", '<', entry_fields,
                     N_FIELDS(entry_fields), ENTRY_SIZE, READS) < 0 ||
        check_names("ConsumeQueue entry", PyDict_GetItemString(layout, "cq_entry_fields"), entry_fields,
                    N_FIELDS(entry_fields), 1, READS) < 0)
        return NULL;
    long long head_size;
    const char *hf = layout_str(layout, "record_header_format");
    if (hf == NULL ||
        check_format("record header", hf, '<', record_head_fields, N_FIELDS(record_head_fields), 1, &head_size,
                     READS) < 0 ||
        check_names("record header", PyDict_GetItemString(layout, "record_header_fields"), record_head_fields,
                    N_FIELDS(record_head_fields), 1, READS) < 0)
        return NULL;
    if (layout_int(layout, "record_magic", &magic) < 0 || layout_int(layout, "crc_start", &crc_start) < 0)
        return NULL;
    if ((uint32_t)magic != MSG_MAGIC || crc_start != CRC_START) {
        PyErr_Format(PyExc_ValueError, "configure: record magic %llx / CRC start %lld, %s %x / %d",
                     magic, crc_start, READS, MSG_MAGIC, CRC_START);
        return NULL;
    }
    configured = 1;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS, "configure(layout): entry and record layouts, checked (module doc)"},
    {"match", py_match, METH_VARARGS, "match(filter, topic) -> bool (MQTT rules, lightqueue/topics.py)"},
    {"crc32", py_crc32, METH_VARARGS, "crc32(data) -> int: zlib.crc32(data), folded with PCLMULQDQ where the CPU has it"},
    {"scan", scan, METH_VARARGS, "ConsumeQueue entries -> the matching records as stored (module doc)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_history",
    "C scan of lightqueue/history.py (the Python reference beside it there)", -1, methods};

PyMODINIT_FUNC PyInit__history(void) { return PyModule_Create(&module); }
