/*
 * delayline: the links between emulated nodes, with latency (this kernel has no netem).
 *
 * It creates one TUN device per node (IFF_TUN: IPv4 packets, no Ethernet header) in the
 * namespace it runs in; netns.sh then moves device k into node k's namespace, where it becomes
 * that node's only interface to the others (qceth0, 10.77.0.<k+1>/24). Every packet a node
 * sends arrives here; it is passed to the destination node's device after
 *
 *     serialization at --rate on the destination's port (a switch port: what a node receives
 *     is limited to the rate, as the bridge-side tbf limits it), then --delay-ms,
 *
 * that is, deliver_at = max(now, previous departure to that node) + bytes * 8 / rate + delay.
 * A packet that would wait more than --queue-ms for its port is dropped, as tbf drops past its
 * latency bound (TCP sees the loss and backs off). What a node sends is shaped by the tbf on
 * its own device, inside its namespace, as on the bridge. Per destination the departures are in
 * order, so each destination's queue is a FIFO; one timerfd wakes the loop at the earliest head.
 *
 * Usage: delayline --delay-ms D [--rate BITS_PER_S] [--queue-ms Q] [--subnet A.B.C] NAME...
 *   NAME k becomes node k (address A.B.C.<k+1>). Prints "ready" on stdout once every device
 *   exists; runs until SIGTERM/SIGINT. Statistics (packets and bytes forwarded and dropped)
 *   go to stderr at exit.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

#define MAX_NODES 32
#define MAX_PACKET 65536

struct packet {
    struct packet *next;
    uint64_t deliver_ns;
    size_t len;
    unsigned char data[];
};

struct port {
    int fd;
    struct packet *head, *tail;
    uint64_t last_departure_ns; /* when the previous packet to this node left its port */
    uint64_t forwarded, forwarded_bytes, dropped;
};

static volatile sig_atomic_t stop;
static void on_signal(int sig) { (void)sig; stop = 1; }

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int open_tun(const char *name) {
    int fd = open("/dev/net/tun", O_RDWR | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
        perror("delayline: open /dev/net/tun");
        exit(1);
    }
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    ifr.ifr_flags = IFF_TUN | IFF_NO_PI;
    strncpy(ifr.ifr_name, name, IFNAMSIZ - 1);
    if (ioctl(fd, TUNSETIFF, &ifr) < 0) {
        fprintf(stderr, "delayline: TUNSETIFF %s: %s\n", name, strerror(errno));
        exit(1);
    }
    return fd;
}

static void usage(void) {
    fprintf(stderr, "usage: delayline --delay-ms D [--rate BITS_PER_S] [--queue-ms Q] "
                    "[--subnet A.B.C] NAME...\n");
    exit(2);
}

int main(int argc, char **argv) {
    double delay_ms = -1, rate = 0, queue_ms = 100;
    unsigned a = 10, b = 77, c = 0;
    const char *names[MAX_NODES];
    int n = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--delay-ms") && i + 1 < argc) delay_ms = atof(argv[++i]);
        else if (!strcmp(argv[i], "--rate") && i + 1 < argc) rate = atof(argv[++i]);
        else if (!strcmp(argv[i], "--queue-ms") && i + 1 < argc) queue_ms = atof(argv[++i]);
        else if (!strcmp(argv[i], "--subnet") && i + 1 < argc) {
            if (sscanf(argv[++i], "%u.%u.%u", &a, &b, &c) != 3) usage();
        } else if (argv[i][0] == '-') usage();
        else if (n < MAX_NODES) names[n++] = argv[i];
        else usage();
    }
    if (delay_ms < 0 || n < 1 || rate < 0 || queue_ms <= 0) usage();
    const uint64_t delay_ns = (uint64_t)(delay_ms * 1e6);
    const uint64_t queue_ns = (uint64_t)(queue_ms * 1e6);
    const double ns_per_byte = rate > 0 ? 8e9 / rate : 0.0;

    struct port ports[MAX_NODES];
    memset(ports, 0, sizeof ports);
    int ep = epoll_create1(EPOLL_CLOEXEC);
    int tfd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
    if (ep < 0 || tfd < 0) {
        perror("delayline: epoll/timerfd");
        return 1;
    }
    struct epoll_event ev = {.events = EPOLLIN, .data.u32 = MAX_NODES};
    epoll_ctl(ep, EPOLL_CTL_ADD, tfd, &ev);
    for (int k = 0; k < n; k++) {
        ports[k].fd = open_tun(names[k]);
        ev.events = EPOLLIN;
        ev.data.u32 = (uint32_t)k;
        epoll_ctl(ep, EPOLL_CTL_ADD, ports[k].fd, &ev);
    }
    signal(SIGTERM, on_signal);
    signal(SIGINT, on_signal);
    printf("ready\n");
    fflush(stdout);

    static unsigned char buf[MAX_PACKET];
    uint64_t armed = 0; /* the deadline the timer is set to (0: none) */
    uint64_t unroutable = 0;
    while (!stop) {
        struct epoll_event events[MAX_NODES + 1];
        int got = epoll_wait(ep, events, MAX_NODES + 1, 1000);
        if (got < 0) {
            if (errno == EINTR) continue;
            perror("delayline: epoll_wait");
            return 1;
        }
        for (int e = 0; e < got; e++) {
            uint32_t k = events[e].data.u32;
            if (k == MAX_NODES) {
                uint64_t expirations;
                while (read(tfd, &expirations, sizeof expirations) > 0) {}
                armed = 0;
                continue;
            }
            for (;;) { /* every packet node k has sent */
                ssize_t len = read(ports[k].fd, buf, sizeof buf);
                if (len < 0) break; /* EAGAIN: drained */
                if (len < 20 || (buf[0] >> 4) != 4 || buf[12] != a || buf[13] != b) {
                    unroutable++;
                    continue;
                }
                int j = (int)buf[19] - 1;
                if (buf[16] != a || buf[17] != b || buf[18] != c || j < 0 || j >= n) {
                    unroutable++;
                    continue;
                }
                struct port *dst = &ports[j];
                uint64_t t = now_ns();
                uint64_t start = dst->last_departure_ns > t ? dst->last_departure_ns : t;
                if (start - t > queue_ns) {
                    dst->dropped++;
                    continue;
                }
                uint64_t departure = start + (uint64_t)(ns_per_byte * (double)len);
                dst->last_departure_ns = departure;
                struct packet *p = malloc(sizeof *p + (size_t)len);
                if (!p) {
                    dst->dropped++;
                    continue;
                }
                p->next = NULL;
                p->len = (size_t)len;
                p->deliver_ns = departure + delay_ns;
                memcpy(p->data, buf, (size_t)len);
                if (dst->tail) dst->tail->next = p;
                else dst->head = p;
                dst->tail = p;
            }
        }
        /* Deliver what is due; arm the timer for the earliest head still waiting. */
        uint64_t t = now_ns(), next = 0;
        for (int j = 0; j < n; j++) {
            struct port *dst = &ports[j];
            while (dst->head && dst->head->deliver_ns <= t) {
                struct packet *p = dst->head;
                if (write(dst->fd, p->data, p->len) == (ssize_t)p->len) {
                    dst->forwarded++;
                    dst->forwarded_bytes += p->len;
                } else {
                    dst->dropped++;
                }
                dst->head = p->next;
                if (!dst->head) dst->tail = NULL;
                free(p);
            }
            if (dst->head && (next == 0 || dst->head->deliver_ns < next)) next = dst->head->deliver_ns;
        }
        if (next && next != armed) {
            struct itimerspec its = {0};
            its.it_value.tv_sec = (time_t)(next / 1000000000ull);
            its.it_value.tv_nsec = (long)(next % 1000000000ull);
            timerfd_settime(tfd, TFD_TIMER_ABSTIME, &its, NULL);
            armed = next;
        }
    }
    for (int j = 0; j < n; j++)
        fprintf(stderr, "delayline: to node %d: %llu packets, %llu bytes forwarded, %llu dropped\n",
                j, (unsigned long long)ports[j].forwarded,
                (unsigned long long)ports[j].forwarded_bytes,
                (unsigned long long)ports[j].dropped);
    if (unroutable) fprintf(stderr, "delayline: %llu unroutable packets\n",
                            (unsigned long long)unroutable);
    return 0;
}
