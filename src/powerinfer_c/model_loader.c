// model_loader.c - opens a model file (standard GGUF or PowerInfer's PWRI variant),
// validates it, parses its metadata and maps the tensor data read-only so weights are
// never copied into the heap.
#include "powerinfer-impl.h"
#include "gguf_reader.h"

#include "ggml-cpu.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

static int32_t read_magic(const char * path, char magic[4], uint64_t * file_size) {
    struct stat st;
    if (stat(path, &st) != 0) {
        return pi_fail(POWERINFER_ERR_IO, "cannot open model file '%s': %s", path, strerror(errno));
    }
    if (!S_ISREG(st.st_mode)) {
        return pi_fail(POWERINFER_ERR_IO, "model path '%s' is not a regular file", path);
    }
    *file_size = (uint64_t) st.st_size;

    FILE * f = fopen(path, "rb");
    if (!f) {
        return pi_fail(POWERINFER_ERR_IO, "cannot open model file '%s': %s", path, strerror(errno));
    }
    size_t n = fread(magic, 1, 4, f);
    fclose(f);
    if (n != 4) {
        return pi_fail(POWERINFER_ERR_FORMAT, "'%s' is not a GGUF model file (only %zu bytes long)", path, n);
    }
    return POWERINFER_OK;
}

static int32_t map_file(const char * path, uint64_t size, struct pi_mapping * map) {
    int fd = open(path, O_RDONLY);
    if (fd < 0) {
        return pi_fail(POWERINFER_ERR_IO, "cannot open model file '%s': %s", path, strerror(errno));
    }
    void * addr = mmap(NULL, size, PROT_READ, MAP_SHARED, fd, 0);
    int err = errno;
    close(fd);
    if (addr == MAP_FAILED) {
        return pi_fail(POWERINFER_ERR_IO, "cannot map model file '%s': %s", path, strerror(err));
    }
    map->addr = addr;
    map->size = size;
    return POWERINFER_OK;
}

// Tensor descriptors (in model->ctx_meta) and where their data starts in the file.
struct placed_tensor {
    struct ggml_tensor * t;
    uint64_t             offset;  // absolute file offset
};

// Standard GGUF: gguf.h parses the header.
static int32_t read_standard(struct powerinfer_model * model, const char * path, struct placed_tensor ** out, int64_t * n_out) {
    struct gguf_init_params gp = { .no_alloc = true, .ctx = &model->ctx_meta };
    model->gguf = gguf_init_from_file(path, gp);
    if (!model->gguf) {
        return pi_fail(POWERINFER_ERR_FORMAT,
                       "'%s' is not a valid GGUF file: its header is truncated or corrupt", path);
    }
    const int64_t n = gguf_get_n_tensors(model->gguf);
    struct placed_tensor * pt = calloc(n ? n : 1, sizeof(*pt));
    if (!pt) {
        return pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory");
    }
    const uint64_t data_offset = gguf_get_data_offset(model->gguf);
    for (int64_t i = 0; i < n; ++i) {
        pt[i].t      = ggml_get_tensor(model->ctx_meta, gguf_get_tensor_name(model->gguf, i));
        pt[i].offset = data_offset + gguf_get_tensor_offset(model->gguf, i);
    }
    *out   = pt;
    *n_out = n;
    return POWERINFER_OK;
}

// PowerInfer GGUF (PWRI magic): our own reader, over the mapping.
static int32_t read_powerinfer(struct powerinfer_model * model, const char * path, struct placed_tensor ** out, int64_t * n_out) {
    struct pi_gguf_file f;
    int32_t rc = pi_gguf_read(path, model->map.addr, model->map.size, &f);
    if (rc != POWERINFER_OK) {
        return rc;
    }
    model->gguf = f.gguf;
    f.gguf = NULL;
    struct ggml_init_params ip = {
        .mem_size   = (size_t) (f.n_tensors + 1) * ggml_tensor_overhead(),
        .mem_buffer = NULL,
        .no_alloc   = true,
    };
    model->ctx_meta = ggml_init(ip);
    struct placed_tensor * pt = calloc(f.n_tensors ? f.n_tensors : 1, sizeof(*pt));
    if (!model->ctx_meta || !pt) {
        free(pt);
        pi_gguf_file_free(&f);
        return pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory");
    }
    for (int64_t i = 0; i < f.n_tensors; ++i) {
        pt[i].t = ggml_new_tensor(model->ctx_meta, f.tensors[i].type, GGML_MAX_DIMS, f.tensors[i].ne);
        ggml_set_name(pt[i].t, f.tensors[i].name);
        pt[i].offset = f.data_offset + f.tensors[i].offset;
    }
    *out   = pt;
    *n_out = f.n_tensors;
    pi_gguf_file_free(&f);
    return POWERINFER_OK;
}

int32_t pi_model_load_file(struct powerinfer_model * model, const char * path) {
    char     magic[4];
    uint64_t file_size = 0;
    int32_t  rc = read_magic(path, magic, &file_size);
    if (rc != POWERINFER_OK) {
        return rc;
    }
    model->is_powerinfer = memcmp(magic, "PWRI", 4) == 0;
    if (!model->is_powerinfer && memcmp(magic, "GGUF", 4) != 0) {
        return pi_fail(POWERINFER_ERR_FORMAT, "'%s' is not a GGUF model file (bad magic)", path);
    }
    if ((rc = map_file(path, file_size, &model->map)) != POWERINFER_OK) {
        return rc;
    }
    struct placed_tensor * pt = NULL;
    int64_t n_tensors = 0;
    rc = model->is_powerinfer ? read_powerinfer(model, path, &pt, &n_tensors)
                              : read_standard(model, path, &pt, &n_tensors);
    if (rc != POWERINFER_OK) {
        free(pt);
        return rc;
    }

    // The header parsers did not look at the tensor data: check that every tensor lies
    // inside the file before anything reads it.
    uint64_t n_bytes = 0, n_params = 0;
    for (int64_t i = 0; i < n_tensors; ++i) {
        const uint64_t off = pt[i].offset, nb = ggml_nbytes(pt[i].t);
        if (off > file_size || nb > file_size - off) {
            rc = pi_fail(POWERINFER_ERR_FORMAT,
                         "'%s' is truncated: tensor '%s' needs bytes up to %llu but the file has %llu",
                         path, ggml_get_name(pt[i].t), (unsigned long long) off + nb, (unsigned long long) file_size);
            free(pt);
            return rc;
        }
        n_bytes += nb;
        n_params += (uint64_t) ggml_nelements(pt[i].t);
    }
    model->n_bytes  = n_bytes;
    model->n_params = n_params;

    model->buf_weights = ggml_backend_cpu_buffer_from_ptr(model->map.addr, model->map.size);
    if (!model->buf_weights) {
        free(pt);
        return pi_fail(POWERINFER_ERR_NO_MEMORY, "cannot create a weight buffer over the mapping");
    }
    ggml_backend_buffer_set_usage(model->buf_weights, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    for (int64_t i = 0; i < n_tensors && rc == POWERINFER_OK; ++i) {
        if (ggml_backend_tensor_alloc(model->buf_weights, pt[i].t, (char *) model->map.addr + pt[i].offset) != GGML_STATUS_SUCCESS) {
            rc = pi_fail(POWERINFER_ERR_INTERNAL, "cannot place tensor '%s' in the mapping", ggml_get_name(pt[i].t));
        }
    }
    free(pt);
    return rc;
}

void pi_model_unload_file(struct powerinfer_model * model) {
    if (model->buf_weights) {
        ggml_backend_buffer_free(model->buf_weights);
        model->buf_weights = NULL;
    }
    if (model->map.addr) {
        munmap(model->map.addr, model->map.size);
        model->map.addr = NULL;
    }
    if (model->ctx_meta) {
        ggml_free(model->ctx_meta);
        model->ctx_meta = NULL;
    }
    if (model->gguf) {
        gguf_free(model->gguf);
        model->gguf = NULL;
    }
}

const struct ggml_tensor * pi_model_file_tensor(const struct powerinfer_model * model, const struct ggml_tensor * t) {
    const struct ggml_tensor * o = ggml_get_tensor(model->ctx_meta, ggml_get_name(t));
    return o && o->data && o->type == t->type && ggml_are_same_shape(o, t) ? o : NULL;
}

void pi_release_mapped_range(const struct powerinfer_model * model, const void * addr, size_t size) {
    const uintptr_t m0 = (uintptr_t) model->map.addr, m1 = m0 + model->map.size;
    if ((uintptr_t) addr < m0 || (uintptr_t) addr + size > m1) {
        return;  // not the file's pages (a copy in memory): dropping those would lose them
    }
    pi_release_pages(addr, size);
}

void pi_release_pages(const void * addr, size_t size) {
    const uintptr_t page  = (uintptr_t) sysconf(_SC_PAGESIZE);
    const uintptr_t begin = ((uintptr_t) addr + page - 1) & ~(page - 1);
    const uintptr_t end   = ((uintptr_t) addr + size) & ~(page - 1);
    if (end > begin) {
        madvise((void *) begin, end - begin, MADV_DONTNEED);
    }
}
