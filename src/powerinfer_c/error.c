// error.c - per-thread last-error message and the log filter shared with ggml and libllama.
#include "powerinfer-impl.h"

#include "llama.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

static _Thread_local char    g_last_error[1024];
static _Thread_local int32_t g_last_status = POWERINFER_OK;
static int32_t g_log_level = POWERINFER_LOG_WARN;

int32_t pi_fail(int32_t status, const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_last_error, sizeof(g_last_error), fmt, ap);
    va_end(ap);
    g_last_status = status;
    pi_log(POWERINFER_LOG_INFO, "error: %s\n", g_last_error);
    return status;
}

void pi_clear_error(void) {
    g_last_error[0] = '\0';
    g_last_status   = POWERINFER_OK;
}

int32_t powerinfer_last_status(void) {
    return g_last_status;
}

const char * powerinfer_last_error(void) {
    return g_last_error;
}

static void log_install(void);

void powerinfer_log_set_level(int32_t level) {
    g_log_level = level;
    // Our filter is put back on every call, not only on the first: another user of the
    // same ggml and libllama may have replaced it since. llama-cpp-python does when it is
    // first imported, which powerinfer_py does after a target's load, and its callback
    // prints every level, ggml's debug lines included ("repack: repack tensor ...").
    log_install();
}

int32_t pi_log_level(void) {
    return g_log_level;
}

void pi_log(int32_t level, const char * fmt, ...) {
    if (level > g_log_level) {
        return;
    }
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
}

static int32_t level_from_ggml(enum ggml_log_level level) {
    switch (level) {
        case GGML_LOG_LEVEL_ERROR: return POWERINFER_LOG_ERROR;
        case GGML_LOG_LEVEL_WARN:  return POWERINFER_LOG_WARN;
        case GGML_LOG_LEVEL_INFO:  return POWERINFER_LOG_INFO;
        default:                   return POWERINFER_LOG_DEBUG;
    }
}

// ggml and libllama continue multi-part messages with GGML_LOG_LEVEL_CONT; they
// inherit the level of the message they continue.
static _Thread_local int32_t g_prev_level = POWERINFER_LOG_DEBUG;

static void log_callback(enum ggml_log_level level, const char * text, void * user_data) {
    (void) user_data;
    int32_t lv = level == GGML_LOG_LEVEL_CONT ? g_prev_level : level_from_ggml(level);
    g_prev_level = lv;
    if (lv <= g_log_level) {
        fputs(text, stderr);
    }
}

static pthread_once_t g_log_once = PTHREAD_ONCE_INIT;

static void log_install(void) {
    ggml_log_set(log_callback, NULL);
    llama_log_set(log_callback, NULL);
}

// A load installs the filter once (powerinfer_log_set_level installs it again each time).
void pi_log_install(void) {
    pthread_once(&g_log_once, log_install);
}

double pi_time_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

const char * powerinfer_version(void) {
    return POWERINFER_VERSION;
}

const char * powerinfer_system_info(void) {
    return llama_print_system_info();
}
