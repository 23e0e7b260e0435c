// device.c - the devices hybrid placement may use: the GPUs and integrated GPUs that
// ggml's backend registry offers, the devices of RPC workers (ggml-rpc, `host:port`), or
// CPU buffers standing in for devices (emulation: tests and machines without a GPU).
#include "powerinfer-impl.h"

#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

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

// Whether something accepts a TCP connection at host:port within a few seconds. ggml-rpc
// aborts the process when it cannot connect (without our patch), so a worker that is down
// is found here first, with a message that names it.
static bool reachable(const char * host, const char * port, char * why, size_t n_why) {
    struct addrinfo hints = { .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM }, * res = NULL;
    const int gai = getaddrinfo(host, port, &hints, &res);
    if (gai != 0) {
        snprintf(why, n_why, "%s", gai_strerror(gai));
        return false;
    }
    bool ok = false;
    for (struct addrinfo * a = res; a && !ok; a = a->ai_next) {
        const int fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
        if (fd < 0) {
            continue;
        }
        const struct timeval tv = { .tv_sec = 5 };
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));  // a connect timeout on Linux
        ok = connect(fd, a->ai_addr, a->ai_addrlen) == 0;
        if (!ok) snprintf(why, n_why, "%s", strerror(errno));
        close(fd);
    }
    freeaddrinfo(res);
    return ok;
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
        const bool up = reachable(ep, colon + 1, why, sizeof(why));
        *colon = ':';
        if (!up) {
            rc = pi_fail(POWERINFER_ERR_IO, "RPC worker %s cannot be reached (%s): is `powerinfer rpc-server` running there?",
                         ep, why);
            break;
        }
        ggml_backend_reg_t reg = add(ep);
        const size_t n_dev = reg ? ggml_backend_reg_dev_count(reg) : 0;
        if (n_dev == 0) {
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
            if (!open_backend(&devs[n], ggml_backend_reg_dev_get(reg, i), ep)) {
                rc = pi_fail(POWERINFER_ERR_IO, "RPC worker %s: its device %zu could not be opened", ep, i);
                break;
            }
            ++n;
        }
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
