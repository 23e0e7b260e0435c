// rpc_worker.c - the RPC worker (`powerinfer rpc-server`): serves this host's CPU as a
// ggml-rpc device, with a cap on the memory clients may allocate there (--mem). Clients are
// PowerInfer-Py's and llama.cpp's (`--rpc host:port`): the protocol is ggml-rpc's.
//
// The cap: a copy of ggml's CPU device whose buffer type counts what it allocates and
// refuses past the cap, and whose memory is reported as the cap (what is left of it, of
// it in all), so clients place within it. The server allocates through the buffer type of
// its backend's device, which is that copy. Its structs come from ggml-backend-impl.h of
// the pinned sdist (found at build time; without it the worker serves uncapped only).
#include "powerinfer-impl.h"

#include "ggml-cpu.h"

#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#if defined(POWERINFER_HAVE_GGML_BACKEND_IMPL)
#include "ggml-backend-impl.h"

static struct ggml_backend_device      g_dev;   // the CPU device, memory capped
static struct ggml_backend_buffer_type g_buft;  // the CPU buffer type, allocations counted
static ggml_backend_buffer_type_t      g_cpu_buft;
static void (*g_cpu_free_buffer)(ggml_backend_buffer_t);
static uint64_t    g_cap;
static atomic_ullong g_used;

static void capped_get_memory(ggml_backend_dev_t dev, size_t * free_b, size_t * total_b) {
    (void) dev;
    const uint64_t used = atomic_load(&g_used);
    *total_b = (size_t) g_cap;
    *free_b  = (size_t) (used < g_cap ? g_cap - used : 0);
}

static void capped_free_buffer(ggml_backend_buffer_t buffer) {
    atomic_fetch_sub(&g_used, (unsigned long long) buffer->size);
    g_cpu_free_buffer(buffer);
}

static ggml_backend_buffer_t capped_alloc_buffer(ggml_backend_buffer_type_t buft, size_t size) {
    (void) buft;
    const uint64_t used = atomic_fetch_add(&g_used, (unsigned long long) size);
    if (used + size > g_cap) {
        atomic_fetch_sub(&g_used, (unsigned long long) size);
        fprintf(stderr, "powerinfer rpc-server: refused %.1f MiB: %.1f of the %.1f MiB of --mem are in use\n",
                size / 1048576.0, used / 1048576.0, g_cap / 1048576.0);
        return NULL;  // the client's allocation fails with a clear error
    }
    ggml_backend_buffer_t b = ggml_backend_buft_alloc_buffer(g_cpu_buft, size);
    if (!b) {
        atomic_fetch_sub(&g_used, (unsigned long long) size);
        return NULL;
    }
    // Counted (at its real size) until it is freed; the buffer is the CPU's in all else.
    if (b->size > size) atomic_fetch_add(&g_used, (unsigned long long) (b->size - size));
    if (b->size < size) atomic_fetch_sub(&g_used, (unsigned long long) (size - b->size));
    g_cpu_free_buffer     = b->iface.free_buffer;
    b->iface.free_buffer  = capped_free_buffer;
    b->buft               = &g_buft;
    return b;
}

static ggml_backend_buffer_type_t capped_get_buffer_type(ggml_backend_dev_t dev) {
    (void) dev;
    return &g_buft;
}

static ggml_backend_t capped_init_backend(ggml_backend_dev_t dev, const char * params) {
    (void) params;
    ggml_backend_t b = ggml_backend_cpu_init();
    if (b) {
        b->device = dev;  // so the server allocates through the capped buffer type
    }
    return b;
}

static ggml_backend_dev_t capped_cpu_device(ggml_backend_dev_t cpu, uint64_t cap) {
    g_cap = cap;
    atomic_store(&g_used, 0);
    g_dev = *cpu;
    g_dev.iface.get_memory      = capped_get_memory;
    g_dev.iface.get_buffer_type = capped_get_buffer_type;
    g_dev.iface.init_backend    = capped_init_backend;
    g_cpu_buft = ggml_backend_dev_buffer_type(cpu);
    g_buft = *g_cpu_buft;
    g_buft.iface.alloc_buffer = capped_alloc_buffer;
    g_buft.device = &g_dev;
    return &g_dev;
}
#endif

typedef void (*rpc_start_server_fn)(const char * endpoint, const char * cache_dir, size_t n_threads, size_t n_devices,
                                    ggml_backend_dev_t * devices);

bool powerinfer_rpc_can_cap_memory(void) {
#if defined(POWERINFER_HAVE_GGML_BACKEND_IMPL)
    return true;
#else
    return false;
#endif
}

int32_t powerinfer_rpc_serve(const char * host, int32_t port, int64_t mem_bytes, int32_t n_threads) {
    pi_clear_error();
    if (!host || !*host || port <= 0 || port > 65535 || mem_bytes < 0) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "powerinfer_rpc_serve: host %s, port %d, mem %lld",
                       host ? host : "(null)", port, (long long) mem_bytes);
    }
    ggml_backend_load_all();
    ggml_backend_reg_t rpc = ggml_backend_reg_by_name("RPC");
    rpc_start_server_fn start = rpc ? (rpc_start_server_fn) ggml_backend_reg_get_proc_address(rpc, "ggml_backend_rpc_start_server")
                                    : NULL;
    if (!start) {
        return pi_fail(POWERINFER_ERR_UNSUPPORTED, "the installed ggml has no RPC backend (build llama-cpp-python with "
                       "-DGGML_RPC=on: scripts/setup.sh does)");
    }
    ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (!cpu) {
        return pi_fail(POWERINFER_ERR_INTERNAL, "no CPU device in ggml's registry");
    }
    ggml_backend_dev_t dev = cpu;
    if (mem_bytes > 0) {
#if defined(POWERINFER_HAVE_GGML_BACKEND_IMPL)
        dev = capped_cpu_device(cpu, (uint64_t) mem_bytes);
#else
        return pi_fail(POWERINFER_ERR_UNSUPPORTED, "--mem: this build cannot cap the worker's memory (libpowerinfer was "
                       "built without ggml-backend-impl.h of the llama-cpp-python sdist; scripts/setup.sh provides it)");
#endif
    }
    char endpoint[300];
    snprintf(endpoint, sizeof(endpoint), "%s:%d", host, port);
    start(endpoint, NULL, (size_t) (n_threads > 0 ? n_threads : 1), 1, &dev);  // returns only if it cannot listen
    return pi_fail(POWERINFER_ERR_IO, "the RPC server could not serve on %s (is the port in use?)", endpoint);
}
