// model_loader.c - opens a model file, validates it, parses GGUF metadata and maps
// the tensor data read-only so weights are never copied into the heap.
#include "powerinfer-impl.h"

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

int32_t pi_model_load_file(struct powerinfer_model * model, const char * path) {
    char     magic[4];
    uint64_t file_size = 0;
    int32_t  rc = read_magic(path, magic, &file_size);
    if (rc != POWERINFER_OK) {
        return rc;
    }
    if (memcmp(magic, "PWRI", 4) == 0) {
        return pi_fail(POWERINFER_ERR_UNSUPPORTED,
                       "'%s' is a PowerInfer-format (PWRI) file; this build reads standard GGUF files only", path);
    }
    if (memcmp(magic, "GGUF", 4) != 0) {
        return pi_fail(POWERINFER_ERR_FORMAT, "'%s' is not a GGUF model file (bad magic)", path);
    }

    struct gguf_init_params gp = { .no_alloc = true, .ctx = &model->ctx_meta };
    model->gguf = gguf_init_from_file(path, gp);
    if (!model->gguf) {
        return pi_fail(POWERINFER_ERR_FORMAT,
                       "'%s' is not a valid GGUF file: its header is truncated or corrupt", path);
    }

    // gguf.h checked the header; with no_alloc it did not look at the tensor data,
    // so check here that every tensor lies inside the file.
    const uint64_t data_offset = gguf_get_data_offset(model->gguf);
    const int64_t  n_tensors   = gguf_get_n_tensors(model->gguf);
    uint64_t n_bytes = 0, n_params = 0;
    for (int64_t i = 0; i < n_tensors; ++i) {
        const char *         name = gguf_get_tensor_name(model->gguf, i);
        struct ggml_tensor * t    = ggml_get_tensor(model->ctx_meta, name);
        const uint64_t       off  = gguf_get_tensor_offset(model->gguf, i);
        const uint64_t       nb   = ggml_nbytes(t);
        if (data_offset > file_size || off > file_size - data_offset || nb > file_size - data_offset - off) {
            return pi_fail(POWERINFER_ERR_FORMAT,
                           "'%s' is truncated: tensor '%s' needs bytes up to %llu but the file has %llu",
                           path, name, (unsigned long long) (data_offset + off + nb), (unsigned long long) file_size);
        }
        n_bytes += nb;
        n_params += (uint64_t) ggml_nelements(t);
    }
    model->n_bytes  = n_bytes;
    model->n_params = n_params;

    rc = map_file(path, file_size, &model->map);
    if (rc != POWERINFER_OK) {
        return rc;
    }
    model->buf_weights = ggml_backend_cpu_buffer_from_ptr(model->map.addr, model->map.size);
    if (!model->buf_weights) {
        return pi_fail(POWERINFER_ERR_NO_MEMORY, "cannot create a weight buffer over the mapping");
    }
    ggml_backend_buffer_set_usage(model->buf_weights, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    for (int64_t i = 0; i < n_tensors; ++i) {
        struct ggml_tensor * t = ggml_get_tensor(model->ctx_meta, gguf_get_tensor_name(model->gguf, i));
        char * addr = (char *) model->map.addr + data_offset + gguf_get_tensor_offset(model->gguf, i);
        if (ggml_backend_tensor_alloc(model->buf_weights, t, addr) != GGML_STATUS_SUCCESS) {
            return pi_fail(POWERINFER_ERR_INTERNAL, "cannot place tensor '%s' in the mapping", ggml_get_name(t));
        }
    }
    return POWERINFER_OK;
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
