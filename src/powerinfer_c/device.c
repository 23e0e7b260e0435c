// device.c - the devices hybrid placement may use: the GPUs and integrated GPUs that
// ggml's backend registry offers, the devices of RPC workers (ggml-rpc, `host:port`), or
// CPU buffers standing in for devices (emulation: tests and machines without a GPU).
#include "powerinfer-impl.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#if defined(__has_include)
#if __has_include("ggml-rpc.h")
#include "ggml-rpc.h"  // RPC_PROTO_*_VERSION: the protocol this build's ggml-rpc speaks
#endif
#endif

static void load_backends(void) {
    static bool loaded = false;
    if (!loaded) {
        ggml_backend_load_all();  // backends built as loadable modules (no-op when linked in)
        loaded = true;
    }
}

static bool open_backend(struct pi_device * d, ggml_backend_dev_t dev, const char * label) {
    ggml_backend_t backend = ggml_backend_dev_init(dev, NULL);
    if (!backend) {
        return false;
    }
    d->dev     = dev;
    d->backend = backend;
    d->buft    = ggml_backend_dev_buffer_type(dev);
    snprintf(d->name, sizeof(d->name), "%s (%s)", ggml_backend_dev_name(dev), label ? label : ggml_backend_dev_description(dev));
    return true;
}

// ---- ggml-rpc endpoints: the handshake with a deadline ------------------------------------
//
// ggml-rpc's client made its connection and handshake (HELLO) with no timeout: an endpoint
// that accepts the connection and never answers (not a ggml-rpc worker, a stopped one, one
// busy with another client: a worker serves one client at a time) blocked the caller for
// ever in recv. Our patch of ggml-rpc (vendor/ggml/patches/ggml-rpc-timeouts.patch) gives
// each of its connections a send and receive timeout of POWERINFER_RPC_TIMEOUT seconds
// (default RPC_TIMEOUT_S), so a command that gets no answer fails the worker
// (pi_device_failed). Before an endpoint is handed to ggml-rpc, the handshake is made here
// too, with a deadline of at most RPC_HANDSHAKE_S, to say which endpoint failed and why.

#define RPC_TIMEOUT_S   120.0  // as in the patch: one graph computed on a slow worker
#define RPC_HANDSHAKE_S 5.0    // the connection and the handshake: a few small messages

// ggml-rpc's handshake (ggml-rpc.cpp, protocol 3 and later): the client sends the command
// byte RPC_CMD_HELLO (14, fixed across versions), the request's size (uint64) and the
// request, its transport capabilities (24 bytes, zero: plain TCP); the worker answers the
// answer's size (uint64) and the answer: major, minor, patch, a padding byte and its own
// capabilities.
enum { RPC_HELLO_CMD = 14, RPC_HELLO_CAPS = 24, RPC_HELLO_ANSWER = 4 + RPC_HELLO_CAPS };

static double rpc_timeout_s(void) {
    const char * env = getenv("POWERINFER_RPC_TIMEOUT");
    char * end = NULL;
    const double t = env ? strtod(env, &end) : 0.0;
    return env && end != env && t > 0.0 && t < 1e6 ? t : RPC_TIMEOUT_S;
}

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t) ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

// n bytes from fd before deadline_ms: 1 read, 0 the peer closed, -1 an error (errno), -2 time out.
static int recv_by(int fd, void * buf, size_t n, int64_t deadline_ms) {
    size_t got = 0;
    while (got < n) {
        const int64_t left = deadline_ms - now_ms();
        if (left <= 0) return -2;
        struct pollfd p = { .fd = fd, .events = POLLIN };
        const int r = poll(&p, 1, (int) left);
        if (r < 0 && errno != EINTR) return -1;
        if (r <= 0) continue;
        const ssize_t k = recv(fd, (char *) buf + got, n - got, 0);
        if (k < 0 && errno != EINTR && errno != EAGAIN) return -1;
        if (k == 0) return 0;
        if (k > 0) got += (size_t) k;
    }
    return 1;
}

// The handshake with the endpoint at one address, before the deadline; false with why.
static bool rpc_hello(const struct addrinfo * a, const char * ep, double limit_s, char * why, size_t n_why) {
    const int64_t deadline = now_ms() + (int64_t) (limit_s * 1000.0);
    const int fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
    if (fd < 0) {
        snprintf(why, n_why, "RPC worker %s: cannot make a socket (%s)", ep, strerror(errno));
        return false;
    }
    const struct timeval tv = { .tv_sec = (time_t) limit_s, .tv_usec = (suseconds_t) ((limit_s - (time_t) limit_s) * 1e6) };
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));  // a connect timeout on Linux
    bool ok = false;
    if (connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
        if (errno == EINPROGRESS || errno == EAGAIN) {  // SO_SNDTIMEO ran out
            snprintf(why, n_why, "RPC worker %s did not accept the connection within %.3g s: it is stopped, or busy "
                     "with other clients, or the network drops the packets", ep, limit_s);
        } else {
            snprintf(why, n_why, "RPC worker %s cannot be reached (%s): is `powerinfer rpc-server` running there?", ep,
                     strerror(errno));
        }
        goto done;
    }
    uint8_t hello[1 + 8 + RPC_HELLO_CAPS] = { RPC_HELLO_CMD };
    const uint64_t size = RPC_HELLO_CAPS;
    memcpy(hello + 1, &size, sizeof(size));  // ggml-rpc sends its sizes in host order (little-endian hosts)
    if (send(fd, hello, sizeof(hello), MSG_NOSIGNAL) != (ssize_t) sizeof(hello)) {
        snprintf(why, n_why, "RPC worker %s: the handshake could not be sent (%s)", ep, strerror(errno));
        goto done;
    }
    uint64_t answer_size = 0;
    uint8_t answer[RPC_HELLO_ANSWER];
    int r = recv_by(fd, &answer_size, sizeof(answer_size), deadline);
    if (r == 1 && answer_size == RPC_HELLO_ANSWER) {
        r = recv_by(fd, answer, sizeof(answer), deadline);
    }
    if (r == -2) {
        snprintf(why, n_why, "RPC worker %s accepted the connection but did not answer the ggml-rpc handshake within "
                 "%.3g s: it is not a ggml-rpc worker, or it is stopped, or it is serving another client (a worker "
                 "serves one at a time)", ep, limit_s);
    } else if (r == 0) {
        snprintf(why, n_why, "RPC worker %s closed the connection during the ggml-rpc handshake: not a ggml-rpc "
                 "worker, or one of another protocol version", ep);
    } else if (r < 0) {
        snprintf(why, n_why, "RPC worker %s: the handshake failed (%s)", ep, strerror(errno));
    } else if (answer_size != RPC_HELLO_ANSWER) {
        snprintf(why, n_why, "RPC worker %s answered the handshake with %llu bytes where a ggml-rpc worker answers "
                 "%d: not a ggml-rpc worker, or one of another protocol version", ep,
                 (unsigned long long) answer_size, RPC_HELLO_ANSWER);
#ifdef RPC_PROTO_MAJOR_VERSION
    } else if (answer[0] != RPC_PROTO_MAJOR_VERSION || answer[1] > RPC_PROTO_MINOR_VERSION) {
        snprintf(why, n_why, "RPC worker %s speaks ggml-rpc protocol %u.%u.%u, this build %d.%d.%d: run the same "
                 "llama.cpp (llama-cpp-python) version on both sides", ep, answer[0], answer[1], answer[2],
                 RPC_PROTO_MAJOR_VERSION, RPC_PROTO_MINOR_VERSION, RPC_PROTO_PATCH_VERSION);
#endif
    } else {
        ok = true;
    }
done:
    close(fd);
    return ok;
}

static bool same_endpoint(const struct sockaddr * s, const struct addrinfo * res) {
    for (const struct addrinfo * a = res; a; a = a->ai_next) {
        if (a->ai_family != s->sa_family) continue;
        if (s->sa_family == AF_INET) {
            const struct sockaddr_in * x = (const void *) s, * y = (const void *) a->ai_addr;
            if (x->sin_port == y->sin_port && x->sin_addr.s_addr == y->sin_addr.s_addr) return true;
        } else if (s->sa_family == AF_INET6) {
            const struct sockaddr_in6 * x = (const void *) s, * y = (const void *) a->ai_addr;
            if (x->sin6_port == y->sin6_port && memcmp(&x->sin6_addr, &y->sin6_addr, sizeof(x->sin6_addr)) == 0) return true;
        }
    }
    return false;
}

// The connections of this process to the endpoint that are open (ggml-rpc's, one per endpoint
// while a model uses it), each shut down if asked; returns how many there are. Linux
// (/proc/self/fd); elsewhere none are found.
static int rpc_connections(const struct addrinfo * res, bool shut_down) {
    DIR * dir = opendir("/proc/self/fd");
    if (!dir) {
        return 0;
    }
    int n = 0;
    for (struct dirent * e; (e = readdir(dir)) != NULL;) {
        char * end = NULL;
        const long fd = strtol(e->d_name, &end, 10);
        if (end == e->d_name || *end || fd == dirfd(dir)) continue;
        int type = 0;
        socklen_t len = sizeof(type);
        if (getsockopt((int) fd, SOL_SOCKET, SO_TYPE, &type, &len) != 0 || type != SOCK_STREAM) continue;
        struct sockaddr_storage peer;
        len = sizeof(peer);
        if (getpeername((int) fd, (struct sockaddr *) &peer, &len) != 0 || !same_endpoint((struct sockaddr *) &peer, res)) continue;
        struct tcp_info info;
        len = sizeof(info);
        if (getsockopt((int) fd, IPPROTO_TCP, TCP_INFO, &info, &len) != 0 || info.tcpi_state != TCP_ESTABLISHED) continue;
        if (shut_down) {
            shutdown((int) fd, SHUT_RDWR);
        }
        ++n;
    }
    closedir(dir);
    return n;
}

typedef ggml_backend_reg_t (*rpc_add_server_fn)(const char * endpoint);

// The RPC workers' devices into devs[n..max); returns the new count or a negative status.
static int32_t open_rpc(struct pi_device * devs, int32_t n, int32_t max, const char * servers) {
    ggml_backend_reg_t rpc = ggml_backend_reg_by_name("RPC");
    rpc_add_server_fn add = rpc ? (rpc_add_server_fn) ggml_backend_reg_get_proc_address(rpc, "ggml_backend_rpc_add_server") : NULL;
    if (!add) {
        return pi_fail(POWERINFER_ERR_UNSUPPORTED, "rpc_servers: the installed ggml has no RPC backend (build "
                       "llama-cpp-python with -DGGML_RPC=on: scripts/setup.sh does)");
    }
    char * list = strdup(servers);
    if (!list) {
        return pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory");
    }
    int32_t rc = POWERINFER_OK;
    char * save = NULL;
    for (char * ep = strtok_r(list, ",", &save); ep && rc == POWERINFER_OK; ep = strtok_r(NULL, ",", &save)) {
        while (*ep == ' ') ++ep;
        char * end = ep + strlen(ep);
        while (end > ep && end[-1] == ' ') *--end = '\0';
        char * colon = strrchr(ep, ':');
        char why[256] = "";
        if (!*ep) {
            continue;
        }
        if (!colon || colon == ep || !colon[1]) {
            rc = pi_fail(POWERINFER_ERR_INVALID_ARG, "rpc_servers: %s is not host:port", ep);
            break;
        }
        *colon = '\0';
        struct addrinfo hints = { .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM }, * res = NULL;
        const int gai = getaddrinfo(ep, colon + 1, &hints, &res);
        *colon = ':';
        if (gai != 0) {
            rc = pi_fail(POWERINFER_ERR_IO, "RPC worker %s cannot be reached (%s): is `powerinfer rpc-server` running "
                         "there?", ep, gai_strerror(gai));
            break;
        }
        // While a model of this process uses the endpoint, ggml-rpc's connection to it is open
        // and reused, and the worker, serving it, would not answer a second one: no handshake
        // then. Else one, with a deadline, before ggml-rpc makes its own without.
        const double timeout = rpc_timeout_s();
        bool up = rpc_connections(res, false) > 0;
        for (const struct addrinfo * a = res; a && !up; a = a->ai_next) {
            up = rpc_hello(a, ep, timeout < RPC_HANDSHAKE_S ? timeout : RPC_HANDSHAKE_S, why, sizeof(why));
        }
        if (!up) {
            freeaddrinfo(res);
            rc = pi_fail(POWERINFER_ERR_IO, "%s", why);
            break;
        }
        ggml_backend_reg_t reg = add(ep);
        const size_t n_dev = reg ? ggml_backend_reg_dev_count(reg) : 0;
        if (n_dev == 0) {
            freeaddrinfo(res);
            rc = pi_fail(POWERINFER_ERR_IO, "RPC worker %s answered but offers no device (a protocol mismatch?)", ep);
            break;
        }
        for (size_t i = 0; i < n_dev && rc == POWERINFER_OK; ++i) {
            if (n == max) {
                rc = pi_fail(POWERINFER_ERR_INVALID_ARG, "more than %d devices", max);
                break;
            }
            memset(&devs[n], 0, sizeof(devs[n]));
            devs[n].rpc = true;
            snprintf(devs[n].endpoint, sizeof(devs[n].endpoint), "%s", ep);
            if (!open_backend(&devs[n], ggml_backend_reg_dev_get(reg, i), ep)) {
                rc = pi_fail(POWERINFER_ERR_IO, "RPC worker %s: its device %zu could not be opened", ep, i);
                break;
            }
            ++n;
        }
        freeaddrinfo(res);
    }
    free(list);
    return rc == POWERINFER_OK ? n : rc;
}

int32_t pi_devices_open(struct pi_device * devs, int32_t max, int32_t n_emulated, const char * rpc_servers) {
    int32_t n = 0;
    if (n_emulated > 0) {
        for (; n < n_emulated && n < max; ++n) {
            memset(&devs[n], 0, sizeof(devs[n]));
            devs[n].emulated = true;
            devs[n].buft     = ggml_backend_cpu_buffer_type();
            if (n_emulated == 1) snprintf(devs[n].name, sizeof(devs[n].name), "CPU emulation");
            else snprintf(devs[n].name, sizeof(devs[n].name), "CPU emulation %d", n);
        }
        return n;
    }
    load_backends();
    for (size_t i = 0; i < ggml_backend_dev_count() && n < max; ++i) {
        ggml_backend_dev_t d = ggml_backend_dev_get(i);
        const enum ggml_backend_dev_type type = ggml_backend_dev_type(d);
        if (type != GGML_BACKEND_DEVICE_TYPE_GPU && type != GGML_BACKEND_DEVICE_TYPE_IGPU) {
            continue;
        }
        memset(&devs[n], 0, sizeof(devs[n]));
        if (open_backend(&devs[n], d, NULL)) {
            ++n;
        }
    }
    if (rpc_servers && *rpc_servers) {
        const int32_t m = open_rpc(devs, n, max, rpc_servers);
        if (m < 0) {
            for (int32_t k = 0; k < n; ++k) pi_device_free(&devs[k]);
            return m;
        }
        n = m;
    }
    return n;
}

int32_t powerinfer_gpu_count(void) {
    load_backends();
    int32_t n = 0;
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        const enum ggml_backend_dev_type type = ggml_backend_dev_type(ggml_backend_dev_get(i));
        n += type == GGML_BACKEND_DEVICE_TYPE_GPU || type == GGML_BACKEND_DEVICE_TYPE_IGPU;
    }
    return n;
}

void * powerinfer_buffer_type_by_name(const char * name) {
    if (!name) {
        return NULL;
    }
    load_backends();
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_buffer_type_t buft = ggml_backend_dev_buffer_type(ggml_backend_dev_get(i));
        if (buft && strcmp(ggml_backend_buft_name(buft), name) == 0) {
            return buft;
        }
    }
    return NULL;
}

int32_t powerinfer_buffer_type_names(char * out, int32_t cap) {
    load_backends();
    size_t len = 0;
    if (out && cap > 0) {
        out[0] = '\0';
    }
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_buffer_type_t buft = ggml_backend_dev_buffer_type(ggml_backend_dev_get(i));
        if (!buft) {
            continue;
        }
        const char * name = ggml_backend_buft_name(buft);
        const size_t at = len;
        len += (at > 0 ? 2 : 0) + strlen(name);
        if (out && cap > 0 && len < (size_t) cap) {
            snprintf(out + at, (size_t) cap - at, "%s%s", at > 0 ? ", " : "", name);
        }
    }
    return (int32_t) len;
}

void pi_device_free(struct pi_device * dev) {
    if (dev->backend) {
        ggml_backend_free(dev->backend);
    }
    memset(dev, 0, sizeof(*dev));
}

void pi_device_memory(const struct pi_device * dev, uint64_t * free_b, uint64_t * total_b) {
    size_t f = 0, t = 0;
    if (dev->dev) {
        ggml_backend_dev_memory(dev->dev, &f, &t);
    } else {
        const long pages = sysconf(_SC_AVPHYS_PAGES), all = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
        f = pages > 0 && page > 0 ? (size_t) pages * (size_t) page : 0;
        t = all > 0 && page > 0 ? (size_t) all * (size_t) page : 0;
    }
    *free_b = f;
    *total_b = t;
}

uint64_t pi_device_alloc_size(const struct pi_device * dev, const struct ggml_tensor * t) {
    const uint64_t align = ggml_backend_buft_get_alignment(dev->buft);
    const uint64_t n     = ggml_backend_buft_get_alloc_size(dev->buft, (struct ggml_tensor *) t);
    return (n + align - 1) / align * align;
}

void pi_device_disconnect(const struct pi_device * dev) {
    char host[sizeof(dev->endpoint)];
    snprintf(host, sizeof(host), "%s", dev->endpoint);
    char * colon = strrchr(host, ':');
    if (!dev->rpc || !colon) {
        return;
    }
    *colon = '\0';
    struct addrinfo hints = { .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM }, * res = NULL;
    if (getaddrinfo(host, colon + 1, &hints, &res) == 0) {
        rpc_connections(res, true);
        freeaddrinfo(res);
    }
}

typedef bool (*rpc_failed_fn)(ggml_backend_t backend);

bool pi_device_failed(const struct pi_device * dev) {
    // ggml_backend_rpc_failed comes with our patch of ggml-rpc (vendor/ggml/patches/); a ggml
    // without it aborts the process itself when a worker goes away.
    static rpc_failed_fn failed = NULL;
    static bool looked = false;
    if (!dev->rpc || !dev->backend) {
        return false;
    }
    if (!looked) {
        // In ggml-rpc's own library, found from a function the registry hands out (the
        // library is a dependency of ours, not in the global scope when Python loaded us).
        ggml_backend_reg_t rpc = ggml_backend_reg_by_name("RPC");
        void * fn = rpc ? ggml_backend_reg_get_proc_address(rpc, "ggml_backend_rpc_add_server") : NULL;
        Dl_info info;
        if (fn && dladdr(fn, &info) && info.dli_fname) {
            void * lib = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
            if (lib) {
                failed = (rpc_failed_fn) dlsym(lib, "ggml_backend_rpc_failed");
                dlclose(lib);  // still loaded: ggml holds it
            }
        }
        looked = true;
    }
    return failed && failed(dev->backend);
}
