/* libFuzzer harness (with AddressSanitizer and UBSan) for the framing core of
 * lmqtt.gateway.mqtt._scan (gateway/mqtt/_scan_core.h): the C code that reads the bytes MQTT
 * clients send. Built and run for a bounded time by tests/fuzz/test_fuzz_harnesses.py; the
 * long run's command and result are in BENCHMARKS.md.
 *
 *   clang -g -O1 -fsanitize=fuzzer,address,undefined -I gateway/mqtt tests/fuzz/scan_fuzz.c -o scan_fuzz
 *   ./scan_fuzz -max_total_time=3600 CORPUS_DIR
 *
 * Input: byte 0 picks MQTT 5 or not and the maximum packet size, byte 1 which first bytes the
 * decoder's state allows, the rest is the receive buffer (scanned from a start inside it). Beyond
 * what the sanitizers catch, each frame is checked against the bytes: inside the buffer, in
 * order, its fields where the packet format puts them.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_scan_core.h"

static const size_t MAXP[4] = {20, 200, 1 << 16, 268435460};

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 3) return 0;
    int v5 = data[0] & 1;
    size_t max_packet = MAXP[(data[0] >> 1) & 3];
    uint8_t ok[256];
    for (int b = 0; b < 256; b++) ok[b] = (data[1] & 1) ? 1 : (((b >> 4) != 3 || (data[1] & 2)) && b != data[2]);
    const uint8_t *buf = data + 3;
    size_t n = size - 3;
    /* an exact-size heap copy: a read one past the end is an ASan report, not a read of the input's tail */
    uint8_t *copy = malloc(n ? n : 1);
    if (!copy) return 0;
    memcpy(copy, buf, n);
    size_t start = n ? (data[2] % (n + 1)) : 0;
    scan_frame fr[8];
    size_t pos = start;
    for (;;) {
        size_t stop;
        size_t k = scan_frames(copy, n, pos, ok, v5, max_packet, fr, 8, &stop);
        size_t at = pos;
        for (size_t i = 0; i < k; i++) {
            scan_frame *f = &fr[i];
            if (copy[at] != f->b0 || !ok[f->b0] || f->end <= at || f->end > n) abort();
            if (f->end - at > max_packet) abort();
            unsigned t = f->b0 >> 4;
            if (t < 3 || t > 7) abort();
            if (t == 3) {
                if (f->tlen == 0 || f->topic < at + 4 || f->topic + f->tlen > f->end) abort();
                if ((((size_t)copy[f->topic - 2] << 8) | copy[f->topic - 1]) != f->tlen) abort();
                if (f->payload < f->topic + f->tlen || f->payload + f->plen != f->end) abort();
                if (((f->b0 >> 1) & 3) == 0 ? f->pid != 0 : f->pid == 0) abort();
                if (v5 && copy[f->payload - 1] != 0) abort();
            } else {
                /* remaining length 2, its varint possibly padded to its 4 bytes (0x82 0x80 0x80
                 * 0x00: the Python decoder takes it too), then the id */
                if (f->end - at < 4 || f->end - at > 7 || f->pid == 0) abort();
                if ((((unsigned)copy[f->end - 2] << 8) | copy[f->end - 1]) != f->pid) abort();
            }
            at = f->end;
        }
        if (stop != at) abort();
        if (k < 8 || stop >= n) break;
        pos = stop;
    }
    free(copy);
    return 0;
}
