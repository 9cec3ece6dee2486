/* The framing core of lmqtt.gateway.mqtt._scan, in plain C (no Python), so that the module
 * (gateway/mqtt/_scan.c) and the libFuzzer harness (tests/fuzz/scan_fuzz.c) run the same code.
 *
 * scan_frames() walks a receive buffer from `pos` and describes the packets of the steady state
 * that it can take whole: PUBLISH (MQTT 3.1/3.1.1; MQTT 5 with an empty property block) and the
 * two-byte PUBACK / PUBREC / PUBREL / PUBCOMP. It stops - without an error, leaving the rest to
 * the Python decoder, which raises the precise ProtocolError - at the first packet that is
 * anything else, incomplete, over the maximum packet size, or breaks a rule (first byte refused
 * by `ok`, remaining length over 4 bytes, topic past the end, packet id 0, an MQTT 5 property
 * block that is not empty, an empty topic). So every error the decoder reports is the Python
 * reference's, and the C side only ever accepts what the reference accepts.
 *
 * The checks that need the topic as text (valid UTF-8, no U+0000, no wildcard) are the caller's:
 * the module decodes with CPython's strict UTF-8 decoder and stops on any doubt; the harness
 * checks the frame bounds this core computed.
 */
#ifndef LMQTT_SCAN_CORE_H
#define LMQTT_SCAN_CORE_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    uint8_t b0;          /* first byte: type << 4 | flags */
    uint16_t pid;        /* packet id (0: a QoS 0 PUBLISH) */
    size_t topic, tlen;  /* PUBLISH: topic bytes at buf[topic], tlen of them */
    size_t payload, plen;/* PUBLISH: payload bytes */
    size_t end;          /* offset just past the packet */
} scan_frame;

/* Up to `max` frames from buf[pos..n) into `out`; returns how many; *stop = where scanning
 * stopped (the start of the first packet not taken). `ok[b0]` != 0: first byte allowed in the
 * decoder's state (its `_ok_first` table). */
static size_t scan_frames(const uint8_t *buf, size_t n, size_t pos, const uint8_t *ok, int v5,
                          size_t max_packet, scan_frame *out, size_t max, size_t *stop) {
    size_t k = 0;
    while (pos < n && k < max) {
        uint8_t b0 = buf[pos];
        if (!ok[b0]) break;
        unsigned t = b0 >> 4;
        if (t < 3 || t > 7) break;
        size_t i = pos + 1;
        if (i >= n) break;
        size_t rl = 0;
        unsigned shift = 0;
        int done = 0;
        for (int nb = 0; nb < 4; nb++) {
            if (i >= n) break;
            uint8_t b = buf[i++];
            rl |= (size_t)(b & 0x7F) << shift;
            if (b < 0x80) { done = 1; break; }
            shift += 7;
        }
        if (!done) break;                 /* incomplete, or longer than 4 bytes: Python decides */
        size_t total = (i - pos) + rl;
        if (total > max_packet) break;
        if (rl > n - i) break;            /* incomplete */
        size_t end = i + rl;
        scan_frame *f = &out[k];
        f->b0 = b0;
        f->end = end;
        f->topic = f->tlen = f->payload = f->plen = 0;
        if (t == 3) {
            unsigned qos = (b0 >> 1) & 3;
            if (end - i < 2) break;
            size_t tlen = ((size_t)buf[i] << 8) | buf[i + 1];
            size_t p = i + 2;
            if (tlen == 0 || tlen > end - p) break;
            f->topic = p;
            f->tlen = tlen;
            p += tlen;
            f->pid = 0;
            if (qos) {
                if (end - p < 2) break;
                f->pid = (uint16_t)(((unsigned)buf[p] << 8) | buf[p + 1]);
                if (f->pid == 0) break;
                p += 2;
            }
            if (v5) {
                if (p >= end || buf[p] != 0) break;   /* properties: the Python decoder's */
                p += 1;
            }
            f->payload = p;
            f->plen = end - p;
        } else {
            if (rl != 2) break;           /* a reason code or properties: the Python decoder's */
            f->pid = (uint16_t)(((unsigned)buf[i] << 8) | buf[i + 1]);
            if (f->pid == 0) break;
        }
        k++;
        pos = end;
    }
    *stop = pos;
    return k;
}

#endif
