// device.c - the device hybrid placement puts weights on: the first GPU (or integrated
// GPU) that ggml's backend registry offers, or a CPU buffer standing in for one
// (emulation: tests and machines without a GPU).
#include "powerinfer-impl.h"

#include <stdio.h>
#include <string.h>

void pi_device_find(struct pi_device * dev, bool emulate) {
    memset(dev, 0, sizeof(*dev));
    if (emulate) {
        dev->emulated = true;
        dev->buft     = ggml_backend_cpu_buffer_type();
        snprintf(dev->name, sizeof(dev->name), "CPU emulation");
        return;
    }
    static bool loaded = false;
    if (!loaded) {
        ggml_backend_load_all();  // backends built as loadable modules (no-op when linked in)
        loaded = true;
    }
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t d = ggml_backend_dev_get(i);
        const enum ggml_backend_dev_type type = ggml_backend_dev_type(d);
        if (type != GGML_BACKEND_DEVICE_TYPE_GPU && type != GGML_BACKEND_DEVICE_TYPE_IGPU) {
            continue;
        }
        ggml_backend_t backend = ggml_backend_dev_init(d, NULL);
        if (!backend) {
            continue;
        }
        dev->backend = backend;
        dev->buft    = ggml_backend_dev_buffer_type(d);
        snprintf(dev->name, sizeof(dev->name), "%s (%s)", ggml_backend_dev_name(d), ggml_backend_dev_description(d));
        return;
    }
}

void pi_device_free(struct pi_device * dev) {
    if (dev->backend) {
        ggml_backend_free(dev->backend);
    }
    memset(dev, 0, sizeof(*dev));
}

uint64_t pi_device_free_memory(const struct pi_device * dev) {
    if (!dev->backend) {
        return 0;
    }
    size_t free_b = 0, total_b = 0;
    ggml_backend_dev_memory(ggml_backend_get_device(dev->backend), &free_b, &total_b);
    return free_b;
}

uint64_t pi_device_alloc_size(const struct pi_device * dev, const struct ggml_tensor * t) {
    const uint64_t align = ggml_backend_buft_get_alignment(dev->buft);
    const uint64_t n     = ggml_backend_buft_get_alloc_size(dev->buft, (struct ggml_tensor *) t);
    return (n + align - 1) / align * align;
}
