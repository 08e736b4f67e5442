/*
 * A fake CUDA driver library (libcuda.so.1) for baleen's tests, written for the agent's MPS
 * client probe (agent/src/isolation/mps/client_probe.rs): the seven driver API calls the probe
 * makes, with what a real driver does under MPS as the GPU days saw it (docs/gpu-day.md,
 * "MPS facts"): a client whose CUDA_MPS_PIPE_DIRECTORY holds a daemon that answers is an MPS
 * client, and CUDA_MPS_PINNED_DEVICE_MEM_LIMIT ("0=<MiB>M") bounds the free memory it sees;
 * without a daemon the driver runs the context without MPS, and it sees the whole GPU free.
 *
 * "A daemon that answers" is a connect() to <pipe>/control that succeeds (the fake MPS control
 * daemon, tests/src/bin/fake-mps-control.rs, listens there).
 *
 * Test directives, one word in `fake-cuda-directives` beside this library (read at cuInit):
 *   fail    cuInit returns CUDA_ERROR_NO_DEVICE (100)
 *   hang    cuCtxCreate_v2 never returns
 *   nomps   the context runs without MPS whatever the pipe directory holds
 * Every cuInit appends a line to `fake-cuda.log` beside the library:
 *   probe visible=<CUDA_VISIBLE_DEVICES> pipe=<CUDA_MPS_PIPE_DIRECTORY> limit=<limit> mps=<0|1>
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <limits.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;

#define TOTAL_BYTES (80ULL << 30)

static int mps_client = 0;
static int hang = 0;
static int context_token = 0;

static void beside(const char *name, char *out, size_t size) {
    Dl_info info;
    out[0] = '\0';
    if (dladdr((void *)&beside, &info) == 0 || info.dli_fname == NULL) return;
    const char *slash = strrchr(info.dli_fname, '/');
    if (slash == NULL) return;
    snprintf(out, size, "%.*s/%s", (int)(slash - info.dli_fname), info.dli_fname, name);
}

static void directive(char *word, size_t size) {
    char path[PATH_MAX];
    word[0] = '\0';
    beside("fake-cuda-directives", path, sizeof path);
    FILE *f = fopen(path, "r");
    if (f == NULL) return;
    if (fscanf(f, "%31s", word) != 1) word[0] = '\0';
    (void)size;
    fclose(f);
}

static int daemon_answers(const char *pipe) {
    if (pipe == NULL) return 0;
    struct sockaddr_un addr;
    memset(&addr, 0, sizeof addr);
    addr.sun_family = AF_UNIX;
    if (snprintf(addr.sun_path, sizeof addr.sun_path, "%s/control", pipe) >=
        (int)sizeof addr.sun_path)
        return 0;
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    if (fd < 0) return 0;
    int ok = connect(fd, (struct sockaddr *)&addr, sizeof addr) == 0;
    close(fd);
    return ok;
}

CUresult cuInit(unsigned int flags) {
    char word[32];
    (void)flags;
    directive(word, sizeof word);
    const char *pipe = getenv("CUDA_MPS_PIPE_DIRECTORY");
    mps_client = strcmp(word, "nomps") != 0 && daemon_answers(pipe);
    hang = strcmp(word, "hang") == 0;
    char path[PATH_MAX];
    beside("fake-cuda.log", path, sizeof path);
    FILE *log = fopen(path, "a");
    if (log != NULL) {
        const char *visible = getenv("CUDA_VISIBLE_DEVICES");
        const char *limit = getenv("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT");
        fprintf(log, "probe visible=%s pipe=%s limit=%s mps=%d\n", visible ? visible : "",
                pipe ? pipe : "", limit ? limit : "", mps_client);
        fclose(log);
    }
    if (strcmp(word, "fail") == 0) return 100;
    return 0;
}

CUresult cuDeviceGetCount(int *count) {
    const char *visible = getenv("CUDA_VISIBLE_DEVICES");
    *count = (visible != NULL && visible[0] == '\0') ? 0 : 1;
    return 0;
}

CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    if (ordinal != 0) return 101; /* CUDA_ERROR_INVALID_DEVICE */
    *device = 0;
    return 0;
}

CUresult cuCtxCreate_v2(CUcontext *context, unsigned int flags, CUdevice device) {
    (void)flags;
    (void)device;
    while (hang) pause();
    *context = &context_token;
    return 0;
}

CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes) {
    *total_bytes = TOTAL_BYTES;
    *free_bytes = TOTAL_BYTES - (512ULL << 20);
    const char *limit = getenv("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT");
    unsigned long long mib;
    if (mps_client && limit != NULL && sscanf(limit, "0=%lluM", &mib) == 1) {
        unsigned long long bytes = (mib << 20) - (2ULL << 20);
        if (bytes < *free_bytes) *free_bytes = bytes;
    }
    return 0;
}

CUresult cuCtxDestroy_v2(CUcontext context) {
    return context == &context_token ? 0 : 201; /* CUDA_ERROR_INVALID_CONTEXT */
}

CUresult cuGetErrorName(CUresult error, const char **name) {
    switch (error) {
    case 0: *name = "CUDA_SUCCESS"; return 0;
    case 100: *name = "CUDA_ERROR_NO_DEVICE"; return 0;
    case 101: *name = "CUDA_ERROR_INVALID_DEVICE"; return 0;
    case 201: *name = "CUDA_ERROR_INVALID_CONTEXT"; return 0;
    default: *name = NULL; return 1; /* CUDA_ERROR_INVALID_VALUE */
    }
}
