/* An independent check of lmqtt's latency generator, in C: the `latency` scenario without any
 * of the generator's code (no Python, no lmqtt codec, no kernel timestamps).
 *
 *   cc -O2 -o latency_harness benchmarks/latency_harness.c
 *   ./latency_harness PORT [PAIRS=50] [RATE=5000] [SECONDS=10]        (host 127.0.0.1)
 *
 * PAIRS publisher/subscriber pairs over MQTT 3.1.1, QoS 1, 64-byte payloads; publisher i
 * publishes to "ch/<pid>/<i>", its subscriber subscribes to it. One thread, one epoll loop:
 * message s of the run is sent at t0 + s / RATE by publisher s % PAIRS (a CLOCK_MONOTONIC
 * timerfd, absolute times: no bursts); the payload starts with the send time (CLOCK_MONOTONIC
 * ns, taken just before send()); a delivery's receive time is read right after the recv()
 * that returned it, in user space, as any client would; subscribers answer PUBACK at once.
 * Prints one JSON line: sent, received, p50/p90/p99/p99.9/max in microseconds.
 * Bounded: SECONDS of sending, then at most 5 s for the last deliveries. Loopback only. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

#define MAXP 1000
#define PAYLOAD 64

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

static void die(const char *what) {
    fprintf(stderr, "latency_harness: %s: %s\n", what, strerror(errno));
    exit(1);
}

static int put_str(unsigned char *b, const char *s) {
    int n = (int)strlen(s);
    b[0] = (unsigned char)(n >> 8);
    b[1] = (unsigned char)(n & 0xff);
    memcpy(b + 2, s, (size_t)n);
    return n + 2;
}

static void read_exact(int fd, unsigned char *b, int n) {
    int got = 0;
    while (got < n) {
        ssize_t r = recv(fd, b + got, (size_t)(n - got), 0);
        if (r <= 0) die("handshake read");
        got += (int)r;
    }
}

static int dial(int port, const char *client_id) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) die("socket");
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) < 0) die("connect");
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    unsigned char b[256];
    int n = 2;
    n += put_str(b + n, "MQTT");
    b[n++] = 4;      /* 3.1.1 */
    b[n++] = 0x02;   /* clean session */
    b[n++] = 0; b[n++] = 60;
    n += put_str(b + n, client_id);
    b[0] = 0x10; b[1] = (unsigned char)(n - 2);
    if (send(fd, b, (size_t)n, 0) != n) die("send CONNECT");
    read_exact(fd, b, 4);
    if (b[0] != 0x20 || b[3] != 0) { fprintf(stderr, "latency_harness: CONNECT refused\n"); exit(1); }
    return fd;
}

static int cmp_u64(const void *x, const void *y) {
    uint64_t a = *(const uint64_t *)x, b = *(const uint64_t *)y;
    return a < b ? -1 : a > b;
}

struct conn { int fd; int sub; int idx; unsigned char buf[65536]; int len; };

int main(int argc, char **argv) {
    if (argc < 2) { fprintf(stderr, "usage: %s PORT [PAIRS] [RATE] [SECONDS]\n", argv[0]); return 2; }
    int port = atoi(argv[1]);
    int pairs = argc > 2 ? atoi(argv[2]) : 50;
    double rate = argc > 3 ? atof(argv[3]) : 5000.0;
    double secs = argc > 4 ? atof(argv[4]) : 10.0;
    if (pairs < 1 || pairs > MAXP || rate <= 0 || secs <= 0 || secs > 600) { fprintf(stderr, "bad arguments\n"); return 2; }
    static struct conn conns[2 * MAXP];
    static char topics[MAXP][64];
    char cid[64];
    int ep = epoll_create1(0);
    for (int i = 0; i < pairs; i++) {
        snprintf(topics[i], sizeof topics[i], "ch/%d/%d", (int)getpid(), i);
        snprintf(cid, sizeof cid, "ch-%d-s%d", (int)getpid(), i);
        struct conn *s = &conns[i];
        s->fd = dial(port, cid); s->sub = 1; s->idx = i;
        unsigned char b[128];
        int n = 2;
        b[n++] = 0; b[n++] = 1;                       /* packet id 1 */
        n += put_str(b + n, topics[i]);
        b[n++] = 1;                                   /* QoS 1 */
        b[0] = 0x82; b[1] = (unsigned char)(n - 2);
        if (send(s->fd, b, (size_t)n, 0) != n) die("send SUBSCRIBE");
        read_exact(s->fd, b, 5);
        if (b[0] != 0x90 || b[4] > 2) { fprintf(stderr, "latency_harness: SUBSCRIBE refused\n"); return 1; }
        snprintf(cid, sizeof cid, "ch-%d-p%d", (int)getpid(), i);
        struct conn *p = &conns[pairs + i];
        p->fd = dial(port, cid); p->sub = 0; p->idx = i;
    }
    for (int i = 0; i < 2 * pairs; i++) {
        struct epoll_event ev = {.events = EPOLLIN, .data.u32 = (uint32_t)i};
        if (epoll_ctl(ep, EPOLL_CTL_ADD, conns[i].fd, &ev) < 0) die("epoll_ctl");
    }
    int tfd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK);
    struct epoll_event tev = {.events = EPOLLIN, .data.u32 = 0xFFFFFFFFu};
    epoll_ctl(ep, EPOLL_CTL_ADD, tfd, &tev);
    size_t cap = (size_t)(rate * secs * 1.1) + 1000;
    uint64_t *lat = malloc(cap * sizeof *lat);
    if (!lat) die("malloc");
    size_t nlat = 0;
    uint64_t interval = (uint64_t)(1e9 / rate);
    uint64_t t0 = now_ns() + 500000000ull, t_end = t0 + (uint64_t)(secs * 1e9);
    uint64_t slot = 0, sent = 0, acked = 0;
    uint16_t pid[MAXP];
    for (int i = 0; i < pairs; i++) pid[i] = 0;
    unsigned char pkt[256];
    struct epoll_event evs[64];
    uint64_t deadline = t_end + 5000000000ull;
    for (;;) {
        uint64_t t = now_ns();
        while (t0 + slot * interval <= t && t0 + slot * interval < t_end) {
            int i = (int)(slot % (uint64_t)pairs);
            struct conn *p = &conns[pairs + i];
            pid[i] = (uint16_t)(pid[i] % 65535 + 1);
            int tl = (int)strlen(topics[i]);
            int rl = 2 + tl + 2 + PAYLOAD;
            int n = 0;
            pkt[n++] = 0x32; pkt[n++] = (unsigned char)rl;
            n += put_str(pkt + n, topics[i]);
            pkt[n++] = (unsigned char)(pid[i] >> 8); pkt[n++] = (unsigned char)(pid[i] & 0xff);
            memset(pkt + n, 'x', PAYLOAD);
            uint64_t stamp = now_ns();
            memcpy(pkt + n, &stamp, 8);
            n += PAYLOAD;
            if (send(p->fd, pkt, (size_t)n, 0) != n) die("send PUBLISH");
            sent++;
            slot++;
        }
        if (t >= t_end && nlat >= sent) break;
        if (t >= deadline) break;
        uint64_t next = t0 + slot * interval;
        if (next >= t_end) next = t + 10000000ull;   /* after the run: wake every 10 ms */
        struct itimerspec its = {0};
        its.it_value.tv_sec = (time_t)(next / 1000000000ull);
        its.it_value.tv_nsec = (long)(next % 1000000000ull);
        timerfd_settime(tfd, TFD_TIMER_ABSTIME, &its, NULL);
        int k = epoll_wait(ep, evs, 64, -1);
        for (int e = 0; e < k; e++) {
            uint32_t id = evs[e].data.u32;
            if (id == 0xFFFFFFFFu) continue;
            struct conn *c = &conns[id];
            ssize_t r = recv(c->fd, c->buf + c->len, sizeof c->buf - (size_t)c->len, 0);
            uint64_t rx = now_ns();
            if (r <= 0) { if (r < 0 && errno == EAGAIN) continue; fprintf(stderr, "latency_harness: connection closed by the broker\n"); return 1; }
            c->len += (int)r;
            int pos = 0;
            unsigned char acks[4096];
            int na = 0;
            while (pos + 2 <= c->len) {
                int rl = c->buf[pos + 1], hdr = 2;
                if (rl & 0x80) {                      /* two-byte remaining length at most here */
                    if (pos + 3 > c->len) break;
                    rl = (rl & 0x7f) | (c->buf[pos + 2] << 7); hdr = 3;
                }
                if (pos + hdr + rl > c->len) break;
                unsigned char type = c->buf[pos] >> 4;
                const unsigned char *body = c->buf + pos + hdr;
                if (type == 3) {                      /* PUBLISH (QoS 1) */
                    int tl = (body[0] << 8) | body[1];
                    const unsigned char *pp = body + 2 + tl;
                    uint64_t stamp;
                    memcpy(&stamp, pp + 2, 8);
                    if (nlat < cap) lat[nlat++] = rx - stamp;
                    if (na + 4 <= (int)sizeof acks) {
                        acks[na++] = 0x40; acks[na++] = 2; acks[na++] = pp[0]; acks[na++] = pp[1];
                    }
                } else if (type == 4) {
                    acked++;
                }
                pos += hdr + rl;
            }
            memmove(c->buf, c->buf + pos, (size_t)(c->len - pos));
            c->len -= pos;
            if (na && send(c->fd, acks, (size_t)na, 0) != na) die("send PUBACK");
        }
    }
    qsort(lat, nlat, sizeof *lat, cmp_u64);
#define P(q) (nlat ? lat[(size_t)((q) / 100.0 * (double)nlat) < nlat ? (size_t)((q) / 100.0 * (double)nlat) : nlat - 1] / 1e3 : 0.0)
    printf("{\"tool\": \"latency_harness.c\", \"pairs\": %d, \"rate\": %.0f, \"sent\": %llu, \"acked\": %llu, "
           "\"received\": %zu, \"p50_us\": %.1f, \"p90_us\": %.1f, \"p99_us\": %.1f, \"p99.9_us\": %.1f, \"max_us\": %.1f}\n",
           pairs, rate, (unsigned long long)sent, (unsigned long long)acked, nlat, P(50), P(90), P(99), P(99.9),
           nlat ? lat[nlat - 1] / 1e3 : 0.0);
    for (int i = 0; i < 2 * pairs; i++) {
        unsigned char d[2] = {0xe0, 0};
        send(conns[i].fd, d, 2, 0);
        close(conns[i].fd);
    }
    return 0;
}
